"""One actor micro-batch through verl's engine on a model with MTP layers, as verl ships or in hook mode.

Why: the A/B script's MTP scenario, the e2e bench's MTP option and the tests
all need the same thing: verl's real build step (`_maybe_enable_fused_kernels`,
with `mtp.enable=True, enable_train=True`), verl's `patch_engine_mtp`, verl's
`forward_step` (which picks the fused or unfused forward and passes the MTP
loss mask), a GRPO-style loss and its backward, and megatron's logged MTP
metrics. verl and megatron-core load on first use.
"""

from __future__ import annotations

from .verl_engine import build_step, megatron_engine

MTP_METRICS = ("loss_values", "correct_values", "total_values")


def build_mtp_engine(model, *, hook: bool, backend: str, model_path, enable_train: bool = True):
    """verl's engine over `model` after its build step and `patch_engine_mtp`; verl as it ships unless `hook`."""
    from verl.utils.megatron_utils import patch_engine_mtp

    engine = megatron_engine(
        [model],
        fused_kernel_options={"output_processor_backend": backend} if hook else None,
        model_path=model_path,
        mtp_enable=True,
        mtp_enable_train=enable_train,
    )
    build_step(model, engine, "1" if hook else None)
    patch_engine_mtp(engine.module, engine.model_config)
    return engine


def mtp_forward(engine, model, batch):
    """verl's forward_step with no loss function: {"log_probs", "entropy"} nested (the MTP loss is attached)."""
    output, _ = engine.forward_step(iter([batch]), model, None, lambda output, **_: output)
    return output


def take_mtp_metrics() -> dict:
    """megatron's logged MTP metrics (loss, acceptance correct/total per MTP layer), then cleared."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    metrics = {key: tracker[key].detach().cpu().clone() for key in MTP_METRICS if key in tracker}
    tracker.clear()
    return metrics
