"""Hook mode on models with MTP layers: the MTP loss through the op, or no MTP at all, as verl's path does.

Why: verl applies its MTP `_postprocess` patch (`mtp_patch.patch_postprocess`)
to every MTP engine, and that patch accepts `output_processor` but never calls
it. For hook-mode models we keep verl's patch for calls without a processor
and route hook calls to megatron-core's own `_postprocess` (kept by verl as
`_postprocess_backup`), which runs the MTP block and `process_mtp_loss`
before the hook. `process_mtp_loss` is looked up in megatron's `gpt_model`
module at call time; our replacement hands every call outside a hook-mode
`_postprocess` to megatron's original and, inside one:

- `mtp.enable_train=False`: the MTP block is not run and no MTP loss exists,
  as in verl's path (which only runs MTP when it passes labels, i.e. when
  training MTP): the MTP layers get no gradient, and nothing builds logits.
- `mtp.enable_train=True`: `fused_process_mtp_loss`, with verl's own MTP loss
  scaling (`mtp_loss_normalization_factor` under `calculate_per_token_loss`)
  and its dynamic context-parallel group, exactly as verl's patch calls
  megatron's `process_mtp_loss`.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools
import logging
from dataclasses import dataclass

from ..log_once import log_once, note
from ..mtp_loss import fused_process_mtp_loss, require_fused_mtp_support
from ..ops import backend_capabilities
from ..probe import unwrap_to_gpt
from ..switch import HOOK
from .model_plan import in_hook_mode, plan_of

logger = logging.getLogger(__name__)

MTP_TRAINING_ATTRIBUTE = "_verl_fused_hook_mtp_training"


@dataclass(frozen=True)
class HookMtpCall:
    """What one hook-mode `_postprocess` call does with its MTP layers."""

    train: bool
    backend: str


_current_call: contextvars.ContextVar[HookMtpCall | None] = contextvars.ContextVar("verl_fused_hook_mtp", default=None)


def set_mtp_training(model, train: bool | None) -> None:
    """Record on the model whether its MTP layers train (verl's `mtp.enable_train`); None forgets it."""
    gpt = unwrap_to_gpt(model)
    if train is None:
        gpt.__dict__.pop(MTP_TRAINING_ATTRIBUTE, None)
    else:
        setattr(gpt, MTP_TRAINING_ATTRIBUTE, bool(train))


def mtp_training_of(model) -> bool:
    return bool(getattr(unwrap_to_gpt(model), MTP_TRAINING_ATTRIBUTE, False))


def mtp_loss_backend(backend: str) -> str:
    """The op backend for the MTP loss: the plan's, unless it has no label-is-max output (acceptance counts)."""
    if not backend_capabilities(backend).label_is_max:
        log_once(
            logger,
            f"verl_fused_hook: output_processor_backend={backend} has no label-is-max output; the MTP loss uses "
            "backend auto",
        )
        return "auto"
    return backend


@contextlib.contextmanager
def hook_mtp_call(call: HookMtpCall):
    """Inside this block megatron's `process_mtp_loss` is replaced as `call` says (see the module doc)."""
    token = _current_call.set(call)
    try:
        yield
    finally:
        _current_call.reset(token)


@contextlib.contextmanager
def keep_fused_kernels_with_mtp(engine, plan):
    """Around verl's `_maybe_enable_fused_kernels`: in hook mode, refuse a megatron-core that cannot run the fused
    MTP loss, then show verl the model config with `mtp.enable=False` so its blanket MTP disable does not fire
    (its other checks still run), then record `mtp.enable_train` on every model and log what runs fused.
    Anything else: no change."""
    real = engine.model_config
    if plan.mode != HOOK or not real.mtp.enable:
        yield
        return
    require_fused_mtp_support(engine.tf_config)
    shown = copy.copy(real)
    object.__setattr__(shown, "mtp", dataclasses.replace(real.mtp, enable=False))  # verl's configs are frozen
    engine.model_config = shown
    try:
        yield
    finally:
        engine.model_config = real
    if not engine.engine_config.use_fused_kernels:
        return
    train = bool(real.mtp.enable_train)
    for model in engine.module:
        set_mtp_training(model, train)
    note(
        logger,
        "verl_fused_hook: hook mode keeps fused kernels on with MTP (actor_rollout_ref.model.mtp.enable=True); %s",
        "mtp.enable_train=True: the MTP loss of every MTP layer goes through the op, no MTP logits"
        if train
        else "mtp.enable_train=False: training forwards skip the MTP layers (no MTP loss or gradient), as verl's path",
    )


def make_process_mtp_loss(original):
    """Replacement for `megatron.core.models.gpt.gpt_model.process_mtp_loss` (megatron calls it with keywords)."""
    from verl.models.mcore.mtp_patch import _get_mtp_loss_config

    @functools.wraps(original)
    def process_mtp_loss(*args, **kwargs):
        call = _current_call.get()
        if call is None:
            return original(*args, **kwargs)
        if not call.train:
            return kwargs["hidden_states"]  # the MTP block did not run: these are the main hidden states
        packed_seq_params = kwargs.get("packed_seq_params")
        kwargs["config"] = _get_mtp_loss_config(kwargs["config"], packed_seq_params)
        dynamic_cp_group = getattr(packed_seq_params, "cp_group", None)
        if dynamic_cp_group is not None:
            kwargs["cp_group"] = dynamic_cp_group
        return fused_process_mtp_loss(**kwargs, backend=call.backend)

    return process_mtp_loss


def make_patch_postprocess(original):
    """Wrap verl's `patch_postprocess` so hook-mode models keep their output_processor (and fuse MTP)."""

    @functools.wraps(original)
    def patch_postprocess(model):
        if not in_hook_mode(model):
            return original(model)
        gpt = unwrap_to_gpt(model)
        original(model)
        patched, megatron_own = gpt._postprocess, gpt._postprocess_backup
        has_mtp = bool(gpt.config.mtp_num_layers)

        @functools.wraps(patched)
        def postprocess_keeping_hook(*args, output_processor=None, output_processor_context=None, **kwargs):
            if output_processor is None:
                return patched(*args, **kwargs)
            hook_kwargs = dict(output_processor=output_processor, output_processor_context=output_processor_context)
            if not has_mtp:
                return megatron_own(*args, **hook_kwargs, **kwargs)
            call = HookMtpCall(train=mtp_training_of(gpt), backend=mtp_loss_backend(plan_of(gpt).backend))
            if not call.train:
                kwargs["mtp_in_postprocess"] = False
            with hook_mtp_call(call):
                return megatron_own(*args, **hook_kwargs, **kwargs)

        gpt._postprocess = postprocess_keeping_hook

    return patch_postprocess


@dataclass(frozen=True)
class MtpStepInputs:
    """What verl's unfused forward gives the MTP loss and the fused forward_step does not pass:
    the loss mask over the whole input (jagged, shaped like input_ids) and verl's
    `mtp_loss_normalization_factor` (routed / batch tokens, under calculate_per_token_loss)."""

    loss_mask: object
    normalization_factor: float | None


def mtp_step_inputs(engine, batch) -> MtpStepInputs:
    """Built from the micro-batch exactly as verl's `forward_step` and `gptmodel_forward_model_engine` build them."""
    from verl.models.mcore.model_forward import _build_mtp_loss_mask_nested
    from verl.utils import tensordict_utils as tu

    inputs = engine.prepare_model_inputs(batch)
    loss_mask, attention_mask = inputs["loss_mask"], inputs["attention_mask"]
    response_attention_mask = None
    if attention_mask is not None and not loss_mask.is_nested:
        response_attention_mask = attention_mask[:, -loss_mask.shape[-1] :]
    lengths = inputs["input_ids"].offsets().diff().tolist()
    factor = None
    if engine.tf_config.calculate_per_token_loss:
        batch_num_tokens = tu.get_non_tensor_data(batch, key="batch_num_tokens", default=0)
        if batch_num_tokens > 0:
            factor = tu.get_non_tensor_data(batch, key="routed_num_tokens", default=0) / batch_num_tokens
    return MtpStepInputs(_build_mtp_loss_mask_nested(loss_mask, lengths, response_attention_mask), factor)
