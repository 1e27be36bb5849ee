"""Our functions at verl's call sites: module and class attributes verl looks up when it calls them.

Why attributes and not edits: verl's engine imports `patch_fused_forward`,
`get_mcore_forward_fused_model_engine_fn`, `patch_postprocess` inside the
functions that use them and calls `_resolve_fused_temperature` and its methods
through module/class lookups, so replacing those attributes reroutes every
call without touching verl's files. Each replacement dispatches on the plan
stored on the model and hands every model without one to verl's original.
The originals are kept (`replacements`), so `restore()` puts verl back exactly.
"""

from __future__ import annotations

import functools
import importlib
import logging

from ..log_once import note
from ..ops import backend_unavailable_at_build
from ..probe import require_output_processor_support, unwrap_to_gpt
from ..switch import CONFIG_BACKEND_KEY, CONFIG_BATCH_INVARIANT_KEY, CONFIG_PREFIX, HOOK, LEGACY, resolve_plan
from .engine_forward import make_engine_forward
from .forward_step import make_forward_step, make_resolve_fused_temperature
from .model_plan import VERL_MODE_ATTRIBUTE, in_hook_mode, plan_of, set_plan
from .mtp import keep_fused_kernels_with_mtp, make_patch_postprocess, make_process_mtp_loss
from .parallel_checks import refuse_unsupported_parallelism
from .replacements import original, restore  # noqa: F401  (call_sites.original/restore: tests and users)
from .replacements import replace as _replace
from .sampling_replay import plan_with_rollout_sampling

logger = logging.getLogger(__name__)

ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"


def _check_backend_at_build(backend: str, gpt, batch_invariant: bool) -> None:
    """Fail at model build, not at the first step, when the configured backend cannot run this model here."""
    import torch

    reason = backend_unavailable_at_build(
        backend,
        hidden_size=gpt.config.hidden_size,
        device_type="cuda" if torch.cuda.is_available() else "cpu",
        batch_invariant=batch_invariant,
    )
    if reason is not None:
        invariant = f" with {CONFIG_PREFIX}.{CONFIG_BATCH_INVARIANT_KEY}=true" if batch_invariant else ""
        raise ValueError(f"{CONFIG_PREFIX}.{CONFIG_BACKEND_KEY}={backend}{invariant} cannot run here: {reason}")


def _make_patch_fused_forward(verl_patch):
    @functools.wraps(verl_patch)
    def patch_fused_forward(model):
        plan = plan_of(model)
        if plan is None:
            return verl_patch(model)
        if plan.mode == LEGACY:
            setattr(unwrap_to_gpt(model), VERL_MODE_ATTRIBUTE, "legacy")  # verl then monkey-patches forward
            return verl_patch(model)
        gpt = require_output_processor_support(model)
        _check_backend_at_build(plan.backend, gpt, plan.batch_invariant)
        setattr(gpt, VERL_MODE_ATTRIBUTE, "hook")  # verl's unpatch/mode helpers then leave forward alone

    return patch_fused_forward


def _make_engine_fn_getter(verl_getter):
    """verl's models get verl's forward; hook-mode models get ours (engine_forward: packed or padded layout,
    as the enclosing forward_step's HookStep says)."""
    from verl.models.mcore.registry import supported_vlm

    @functools.wraps(verl_getter)
    def get_mcore_forward_fused_model_engine_fn(hf_config):
        verl_forward = verl_getter(hf_config)
        hook_forward = make_engine_forward(vision_model=hf_config.architectures[0] in supported_vlm)

        def fused_forward(model, *args, **kwargs):
            forward = hook_forward if in_hook_mode(model) else verl_forward
            return forward(model, *args, **kwargs)

        return fused_forward

    return get_mcore_forward_fused_model_engine_fn


def install_call_sites() -> None:
    """Reroute verl's fused-forward call sites through the plan on each model (idempotent)."""
    mcore = importlib.import_module("verl.models.mcore")
    fused = importlib.import_module("verl.models.mcore.model_forward_fused")
    mtp_patch = importlib.import_module("verl.models.mcore.mtp_patch")
    gpt_model = importlib.import_module("megatron.core.models.gpt.gpt_model")
    engine = importlib.import_module(ENGINE_MODULE)
    _replace(fused, "patch_fused_forward", _make_patch_fused_forward)
    _replace(mcore, "get_mcore_forward_fused_model_engine_fn", _make_engine_fn_getter)
    _replace(mtp_patch, "patch_postprocess", make_patch_postprocess)
    _replace(gpt_model, "process_mtp_loss", make_process_mtp_loss)
    _replace(engine, "_resolve_fused_temperature", make_resolve_fused_temperature)
    _replace(engine.MegatronEngineWithLMHead, "forward_step", make_forward_step)


# verl's reasons (`MegatronEngine._maybe_enable_fused_kernels`) for turning fused kernels off.
REMOVE_PADDING_OFF = "use_remove_padding=False"
VALUE_MODEL = "value model"
MTP_ENABLED = "mtp.enable=True"


def verl_disabling_reasons(engine) -> list[str]:
    """Which of verl's reasons to turn fused kernels off apply to this engine (verl's own test, by reason)."""
    reasons = []
    if not engine.engine_config.use_remove_padding:
        reasons.append(REMOVE_PADDING_OFF)
    if engine.is_value_model:
        reasons.append(VALUE_MODEL)
    if engine.model_config.mtp.enable:
        reasons.append(MTP_ENABLED)
    return reasons


def reasons_hook_mode_lifts(reasons: list[str]) -> frozenset[str]:
    """verl's disabling reasons that do not hold in hook mode: the one place such decisions are made.

    Padded batches: the engine forward runs the hook on verl's BSHD layout (layouts.PaddedLayout). MTP: the MTP loss
    goes through the op
    (mtp.py) on packed (THD) batches; an MTP engine on the padded layout as well keeps verl's disable.
    """
    if REMOVE_PADDING_OFF in reasons:
        return frozenset({REMOVE_PADDING_OFF})
    return frozenset({MTP_ENABLED})


def _enable_despite(engine, lifted: list[str], log_line: str) -> None:
    """What verl's build step does when nothing stops it (patch each model chunk), for an engine verl would refuse."""
    fused = importlib.import_module("verl.models.mcore.model_forward_fused")
    for model in engine.module:
        fused.patch_fused_forward(model)  # our replacement: probe and backend checks, verl's mode record
    note(logger, "%s; fused kernels kept on with %s (verl would turn them off)", log_line, ", ".join(lifted))


def _make_build_gate(verl_enable):
    @functools.wraps(verl_enable)
    def _maybe_enable_fused_kernels(self):
        plan = resolve_plan(getattr(self.model_config, "fused_kernel_options", None))
        name = type(self).__name__
        if not plan.is_set:
            note(logger, plan.log_line(name))
            return verl_enable(self)
        install_call_sites()
        if not self.engine_config.use_fused_kernels:
            logger.warning(
                "%s; but actor_rollout_ref.model.use_fused_kernels is False, so the switch has no effect",
                plan.log_line(name),
            )
            return verl_enable(self)
        if plan.mode == HOOK:
            refuse_unsupported_parallelism(self)
            plan = plan_with_rollout_sampling(plan)
        reasons = verl_disabling_reasons(self)
        lifted = [reason for reason in reasons if plan.mode == HOOK and reason in reasons_hook_mode_lifts(reasons)]
        for model in self.module:
            set_plan(model, plan)
        try:
            if MTP_ENABLED in lifted:  # verl's other checks (value model) still run on what it is shown
                with keep_fused_kernels_with_mtp(self, plan):
                    verl_enable(self)
            elif reasons and len(lifted) == len(reasons):
                _enable_despite(self, lifted, plan.log_line(name))
                return
            else:
                verl_enable(self)
        except BaseException:
            for model in self.module:
                set_plan(model, None)
            raise
        if not self.engine_config.use_fused_kernels:
            for model in self.module:
                set_plan(model, None)
            logger.warning(
                "%s; but verl turned fused kernels off for this engine (%s), so the switch has no effect",
                plan.log_line(name),
                ", ".join(reasons),
            )
            return
        note(logger, plan.log_line(name))

    return _maybe_enable_fused_kernels


def install_build_gate(engine_module) -> None:
    """Read the switch where verl enables fused kernels (idempotent); everything else waits for a set plan."""
    _replace(engine_module.MegatronEngine, "_maybe_enable_fused_kernels", _make_build_gate)
