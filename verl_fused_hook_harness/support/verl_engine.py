"""verl's real Megatron engine object, holding models we built, for driving its build step and forward_step.

Why: `MegatronEngine.initialize` needs GPUs, checkpoints and an optimizer,
but the two methods the plugin wires into (`_maybe_enable_fused_kernels` at
build, `forward_step` per micro-batch) read only a few fields. We create a
real `MegatronEngineWithLMHead` without running its GPU set-up and give it
real verl config dataclasses, a real (in-memory) tokenizer and the models.
"""

from __future__ import annotations

from pathlib import Path

from .hf_model import TINY_QWEN2


def word_level_tokenizer(vocab_size: int, pad_token_id: int = 0):
    """A real transformers tokenizer over ids 0..vocab_size-1 (no files needed)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=f"t{pad_token_id}"))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=f"t{pad_token_id}", unk_token=f"t{pad_token_id}")


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
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from verl.workers.config.model import MtpConfig

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
