"""verl's `MegatronEngineWithLMHead`, initialised by verl itself except for the one step that needs Transformer Engine.

Why: a training-loop comparison should run verl's engine as the trainer does:
`MegatronEngine.__init__` and `initialize()` (transformer config through
mbridge's conversion, DDP wrapping, the fused-kernel build step, optimizer,
LR scheduler, checkpoint manager, offload), then `train_batch` /
`infer_batch`, `lr_scheduler_step`, `save_checkpoint` / `load_checkpoint`.
Only `_build_megatron_module` is replaced, by one of two builds of the same
random model: on Transformer Engine's spec `build_as_verl_does`, verl's own
build (mbridge's, or Megatron-Bridge's with `bridge`) up to its checkpoint load
(there is no checkpoint for a random model);
on the local spec the stand-in of `stand_ins/local_spec_build.py` (verl's
bridges build TE's layer spec only, which does not build without TE). verl and
megatron-core load on first use.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from ..stand_ins.cuda_on_cpu import cuda_names_on_cpu
from .grpo_batches import PAD_TOKEN_ID
from .hf_model import local_spec_overrides, word_level_tokenizer
from .layer_spec import BRIDGES, BUILT_SPECS, LOCAL, MBRIDGE, TE

# The output of every dropout must not depend on RNG draws, so that any two runs compare bit for bit.
TRANSFORMER_OVERRIDES = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "masked_softmax_fusion": False}


@dataclass(frozen=True)
class EngineSetup:
    """What verl's config files would say for one engine (actor or reference)."""

    hf_path: str
    tp: int
    dtype: str  # "bfloat16" or "float32"
    seed: int
    micro_batch_size: int
    total_steps: int
    lr: float
    offload: bool
    fused_kernel_options: dict
    # megatron's parallel layout beyond TP (the process group's megatron state must match it)
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    use_fused_kernels: bool = True  # False: verl's unfused path (full logits), the parity tests' reference
    use_remove_padding: bool = True  # False: verl's padded (BSHD) layout
    pad_bshd_to_minibatch_max: bool = True  # verl's default: padded micro-batches to the mini-batch's longest
    transformer_overrides: dict | None = None  # more of verl's override_transformer_config (e.g. MoE, MTP)
    mtp: bool = False  # actor_rollout_ref.model.mtp.enable (and enable_train)
    distributed_optimizer: bool = True  # False: every rank holds its full DP-averaged gradients after a step
    layout_independent_weights: bool = False  # every PP/EP layout of one TP size holds the same model
    layer_spec: str = LOCAL  # TE: built through verl's own build (build_as_verl_does); resolved, not auto
    bridge: str = MBRIDGE  # verl's builder: mbridge (vanilla_mbridge=True) or Megatron-Bridge (TE's spec only)


def build_engine(setup: EngineSetup, *, forward_only: bool = False):
    """A MegatronEngineWithLMHead through verl's __init__ and initialize() (model build replaced, see above).

    Call on an initialised process group; megatron's parallel state is initialised here when it is not yet."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    if setup.dtype not in ("bfloat16", "float32"):
        raise ValueError(f"EngineSetup.dtype: {setup.dtype!r}; allowed: bfloat16, float32")
    if setup.layer_spec not in BUILT_SPECS:
        raise ValueError(f"EngineSetup.layer_spec: {setup.layer_spec!r}; allowed: {', '.join(BUILT_SPECS)}")
    if setup.layer_spec == TE and setup.layout_independent_weights:
        raise ValueError("EngineSetup: layout-independent weights are drawn by the local-spec build only")
    if setup.bridge not in BRIDGES:
        raise ValueError(f"EngineSetup.bridge: {setup.bridge!r}; allowed: {', '.join(BRIDGES)}")
    if setup.bridge != MBRIDGE and setup.layer_spec != TE:
        raise ValueError(f"EngineSetup.bridge={setup.bridge!r} builds Transformer Engine's spec only (layer_spec te)")
    from verl.workers.config.model import MtpConfig

    model_config = HFModelConfig(
        path=setup.hf_path,
        load_tokenizer=False,
        use_fused_kernels=setup.use_fused_kernels,
        fused_kernel_options=dict(setup.fused_kernel_options),
        mtp=MtpConfig(enable=setup.mtp, enable_train=setup.mtp),
    )
    model_config.tokenizer = word_level_tokenizer(model_config.hf_config.vocab_size, PAD_TOKEN_ID)
    local_spec = {} if setup.layer_spec == TE else local_spec_overrides(model_config.hf_config)
    engine_config = McoreEngineConfig(
        use_mbridge=True,
        vanilla_mbridge=setup.bridge == MBRIDGE,  # mbridge's config conversion, or Megatron-Bridge's provider
        use_fused_kernels=setup.use_fused_kernels,
        use_remove_padding=setup.use_remove_padding,
        pad_bshd_to_minibatch_max=setup.pad_bshd_to_minibatch_max,
        forward_only=forward_only,
        tensor_model_parallel_size=setup.tp,  # with TP > 1 mbridge's conversion turns sequence parallelism on
        pipeline_model_parallel_size=setup.pp,
        virtual_pipeline_model_parallel_size=setup.vpp,
        context_parallel_size=setup.cp,
        expert_model_parallel_size=setup.ep,
        use_distributed_optimizer=setup.distributed_optimizer,
        use_dist_checkpointing=True,
        param_offload=setup.offload,
        optimizer_offload=setup.offload,
        seed=setup.seed,
        dtype="bfloat16",  # verl accepts bfloat16/float16 only; float32 is set below (CPU runs)
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=setup.micro_batch_size,
        infer_micro_batch_size_per_gpu=setup.micro_batch_size,
        override_transformer_config={
            **TRANSFORMER_OVERRIDES,
            "use_cpu_initialization": not torch.cuda.is_available(),
            **local_spec,
            **(setup.transformer_overrides or {}),
        },
    )
    if setup.dtype == "float32":
        object.__setattr__(engine_config, "dtype", "float32")
    # verl's default linear LR decay over the run; the scheduler's position is saved and restored with the
    # checkpoint (verl's default, use_checkpoint_opt_param_scheduler=False, restarts the schedule on resume).
    optimizer_config = McoreOptimizerConfig(
        lr=setup.lr, clip_grad=1.0, total_training_steps=setup.total_steps, use_checkpoint_opt_param_scheduler=True
    )
    checkpoint_config = CheckpointConfig(
        save_contents=["model", "optimizer", "extra"], load_contents=["model", "optimizer", "extra"]
    )
    engine = MegatronEngineWithLMHead(model_config, engine_config, optimizer_config, checkpoint_config)
    if setup.layer_spec == TE:
        engine._build_megatron_module = lambda: build_as_verl_does(engine, setup.seed)
    else:
        from ..stand_ins.local_spec_build import use_local_spec_build

        use_local_spec_build(engine, setup.seed, setup.layout_independent_weights)
    with cuda_names_on_cpu():
        engine.initialize()
    return engine


def build_as_verl_does(engine, seed: int):
    """What verl's `_build_megatron_module` builds, up to its checkpoint load: verl's `make_megatron_module` with the
    engine's own arguments, that is mbridge's `get_model` over mbridge's model provider (Transformer Engine's layer
    spec, hard-coded there; the plugin's mbridge_compat fix lets it run on megatron-core >= 0.18), or with
    `vanilla_mbridge=False` Megatron-Bridge's provider (TE's spec too), then `Float16Module` in bf16 and megatron's
    DDP. The weights are megatron's initialisation from `seed`, the same in every engine built with it (verl would
    then load a checkpoint: a random model has none)."""
    from verl.utils.megatron.optimizer import is_muon_layer_wise_config
    from verl.utils.megatron_utils import McoreModuleWrapperConfig, make_megatron_module

    if torch.cuda.is_available():
        from megatron.core import tensor_parallel

        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        from ..stand_ins.megatron_cpu import seed_model_parallel_rng

        seed_model_parallel_rng(seed)  # megatron's CUDA seeding, on the CPU's tracker
    config = engine.engine_config
    wrap_config = McoreModuleWrapperConfig(
        is_value_model=engine.is_value_model,
        wrap_with_ddp=not config.forward_only,
        use_distributed_optimizer=config.use_distributed_optimizer,
        use_layer_wise_distributed_optimizer=is_muon_layer_wise_config(engine.optimizer_config),
        use_megatron_fsdp=config.use_megatron_fsdp,
    )
    module, engine.tf_config = make_megatron_module(
        wrap_config=wrap_config,
        tf_config=engine.tf_config,
        hf_config=engine.model_config.hf_config,
        bridge=engine.bridge,
        provider=engine.provider,
        override_model_config=config.override_mcore_model_config,
        override_ddp_config=engine._resolve_override_ddp_config(),
        peft_cls=engine.peft_cls,
        peft_config=engine.model_config.get("lora", None),
    )
    return module


def _torch_adams(engine):
    for optimizer in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        if isinstance(optimizer.optimizer, (torch.optim.Adam, torch.optim.AdamW)):
            yield optimizer.optimizer


def load_checkpoint_for_resume(engine, path: str) -> None:
    """verl's `engine.load_checkpoint(path)`, with two workarounds for megatron-core's DistributedOptimizer on
    PyTorch's Adam (what it uses without Apex or Transformer Engine, as on every machine here):

    - before: `DistributedOptimizer.state_dict()` (called by `sharded_state_dict(is_loading=True)` inside the
      load) asserts one common 'step' over the Adam state, which PyTorch creates only at the first step: a
      fresh optimizer has none and the load fails. It gets zero moments and step 0 (what the first step would
      create); the load overwrites the moments;
    - after: the load puts the checkpoint's step into the param groups, then copies each parameter's state
      from the loaded tensors, where 'step' still holds the template's 0 (Adam's bias correction would then
      restart). Each parameter's step is set from its param group's restored step.
    The load itself runs under no_grad: with fp32 parameters the optimizer's main params are views of leaves
    that require grad, which the loader copies into in place."""
    for adam in _torch_adams(engine):
        for group in adam.param_groups:
            for param in group["params"]:
                if not adam.state[param]:
                    adam.state[param] = {
                        "step": torch.tensor(0.0),
                        "exp_avg": torch.zeros_like(param),
                        "exp_avg_sq": torch.zeros_like(param),
                    }
    with torch.no_grad():
        engine.load_checkpoint(path, del_local_after_load=False)
    for adam in _torch_adams(engine):
        for group in adam.param_groups:
            if "step" not in group:
                raise RuntimeError("load_checkpoint: the optimizer's param groups carry no restored 'step'")
            for param in group["params"]:
                adam.state[param]["step"] = torch.tensor(float(group["step"]))


def fused_loss_forwards(engine) -> int:
    """How many forwards of `engine` computed their loss inside the op (the plugin's own count): the proof that a
    fused-loss side ran verl's ppo_loss inside the op, and that no other side did. The plugin is imported only here:
    an engine built without it (test_engine_release's "absent" setup) must import none of it."""
    from verl_fused_hook.verl_integration.model_plan import counts_of

    return sum(counts_of(chunk).fused_loss_forwards for chunk in engine.module)


# What verl's `register_megatron_training_hooks` sets on each model chunk's TransformerConfig (all default None).
TRAINING_HOOK_FIELDS = (
    "grad_scale_func",
    "finalize_model_grads_func",
    "no_sync_func",
    "grad_sync_func",
    "param_sync_func",
)


def release_engines(*engines) -> None:
    """Free verl engines (model, gradients, optimizer state) at once, before the next ones are built.

    Dropping the engine's attributes is not enough (docs/benchmarks.md, tests/test_engine_release.py): verl's
    `register_megatron_training_hooks` puts `grad_scale_func = optimizer.scale_loss` on the model's
    TransformerConfig, shared by every module, so the optimizer (and through its model chunks the DDP, the
    GPTModel and every buffer) stays reachable from the config; in fp32, megatron's optimizer shards are
    autograd views of the parameters, which hides DDP's hooks from the collector. Clearing those config fields
    first leaves plain Python cycles that one collection frees, in either dtype."""
    for engine in engines:
        _drop(engine)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _drop(engine) -> None:
    """Clear the training hooks on the model's configs, then the engine's references (in a function of its own:
    a loop variable left on the DDP would keep it alive through the collection)."""
    from megatron.core.utils import get_model_config

    for config in [get_model_config(chunk) for chunk in engine.module or ()] + [getattr(engine, "tf_config", None)]:
        for field in TRAINING_HOOK_FIELDS:
            if config is not None and hasattr(config, field):
                setattr(config, field, None)
    engine.module = engine.optimizer = engine.lr_scheduler = None
    engine.checkpoint_mananager = None  # sic: verl's spelling
