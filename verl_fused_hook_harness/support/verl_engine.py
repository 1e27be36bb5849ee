"""verl's real Megatron engine object, holding models we built, for driving its build step and forward_step.

Why: `MegatronEngine.initialize` needs GPUs, checkpoints and an optimizer,
but the two methods the plugin wires into (`_maybe_enable_fused_kernels` at
build, `forward_step` per micro-batch) read only a few fields. We create a
real `MegatronEngineWithLMHead` without running its GPU set-up and give it
real verl config dataclasses, a real (in-memory) tokenizer and the models.
The build step runs as verl runs it; the mode it picks comes from the
environment switch, set here as a user sets it. verl is imported on first use
(`import verl` starts ray).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from verl_fused_hook.probe import unwrap_to_gpt
from verl_fused_hook.switch import ENV_VAR
from verl_fused_hook.verl_integration import install
from verl_fused_hook.verl_integration.model_plan import VERL_MODE_ATTRIBUTE, set_plan

from .hf_model import TINY_QWEN2, word_level_tokenizer

UNFUSED = "unfused"  # what `build_step` reports when verl's build step turned fused kernels off


def prepare_verl_process(rank: int = 0) -> None:
    """What a process driving verl's engine does first: the plugin installed (what `import verl` does through
    the entry point when the package is installed), its log lines from rank 0 only, and verl's engine module
    imported (which fires the plugin's build gate)."""
    install()
    if rank != 0:
        logging.getLogger("verl_fused_hook").setLevel(logging.WARNING)  # one log line per engine, not per rank
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401


def megatron_engine(
    models,
    *,
    fused_kernel_options: dict | None = None,
    model_path: str | Path = TINY_QWEN2,
    use_fused_kernels: bool = True,
    forward_only: bool = False,
    mtp_enable: bool = False,
    use_remove_padding: bool = True,
    mtp_enable_train: bool = False,
):
    """A MegatronEngineWithLMHead over `models` (a list of model chunks), ready for
    `_maybe_enable_fused_kernels()` and `forward_step(...)`."""
    from verl.workers.config import HFModelConfig, McoreEngineConfig
    from verl.workers.config.model import MtpConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    model_config = HFModelConfig(
        path=str(model_path),
        load_tokenizer=False,
        use_fused_kernels=use_fused_kernels,
        fused_kernel_options=dict(fused_kernel_options or {}),
        mtp=MtpConfig(enable=mtp_enable, enable_train=mtp_enable_train),
    )
    model_config.tokenizer = word_level_tokenizer(model_config.hf_config.vocab_size)
    engine = MegatronEngineWithLMHead.__new__(MegatronEngineWithLMHead)
    engine.model_config = model_config
    engine.engine_config = McoreEngineConfig(
        use_fused_kernels=use_fused_kernels,
        use_mbridge=True,
        forward_only=forward_only,
        use_remove_padding=use_remove_padding,  # False: verl's padded (BSHD) layout
    )
    engine.is_value_model = False
    engine.enable_routing_replay = False
    engine.tf_config = models[0].config
    engine.module = list(models)
    return engine


def fused_engine_forward(engine, model, input_ids, temperature, **extra):
    """verl's fused engine forward, looked up as verl's forward_step looks it up (so the plugin's reroute
    applies) and called with forward_step's arguments: labels are the input ids, which verl rolls."""
    import verl.models.mcore as mcore

    forward = mcore.get_mcore_forward_fused_model_engine_fn(engine.model_config.hf_config)
    return forward(
        model=model,
        input_ids=input_ids,
        labels=input_ids.clone(),
        multi_modal_inputs={},
        temperature=temperature,
        calculate_entropy=True,
        pad_token_id=engine.model_config.tokenizer.pad_token_id,
        **extra,
    )


def reset_fused_mode(model) -> None:
    """Undo a previous build step on this model (verl's unpatch, verl's mode record, the plugin's plan), so
    one model can be built into another mode. verl keeps its record on the GPTModel inside any wrapper."""
    from verl.models.mcore.model_forward_fused import unpatch_fused_forward

    unpatch_fused_forward(model)
    unwrap_to_gpt(model).__dict__.pop(VERL_MODE_ATTRIBUTE, None)
    set_plan(model, None)


def build_step(model, engine, switch: str | None) -> str | None:
    """verl's build step (`_maybe_enable_fused_kernels`) on `engine` over `model` with VERL_FUSED_USE_OP_HOOK
    set to `switch` ("1", "0"; None: unset, verl as it ships) for its duration; returns the mode it resolved
    (`resolved_mode`). The model keeps the mode: the step records it on the model."""
    reset_fused_mode(model)
    saved = os.environ.pop(ENV_VAR, None)
    if switch is not None:
        os.environ[ENV_VAR] = switch
    engine.engine_config.use_fused_kernels = True  # as configured; verl's build step decides
    try:
        engine._maybe_enable_fused_kernels()
    finally:
        os.environ.pop(ENV_VAR, None)
        if saved is not None:
            os.environ[ENV_VAR] = saved
    return resolved_mode(model, engine)


def resolved_mode(model, engine) -> str | None:
    """The mode verl's build step left on `model`: "hook", "legacy", "unfused" (fused kernels off) or None."""
    return (
        getattr(unwrap_to_gpt(model), VERL_MODE_ATTRIBUTE, None) if engine.engine_config.use_fused_kernels else UNFUSED
    )
