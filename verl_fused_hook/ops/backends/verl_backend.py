"""verl's own Triton kernel as a whole-problem backend: `backend="verl"`.

Why: A/B runs against verl's fused path must run verl's kernel exactly as verl does, and
through the op they get its argument checks and tensor-parallel wiring. The kernel,
`verl.utils.kernel.linear_cross_entropy.linear_cross_entropy(hidden, weight, labels,
temperature, "none", tp_group)`, is one autograd function (statistics and gradients in one
call) over every row and every column at one float temperature, so this backend refuses what
it cannot take, naming the field, and the loss-inside op refuses it. Under tensor parallelism
its d_hidden is the shard's partial one; the op's `tp_hidden` completes it like any backend's.
"""

from __future__ import annotations

import torch

from ..arguments import LogProbProblem

HIDDEN_MULTIPLE = 128  # verl's kernel asserts hidden_size % 128 == 0


def unavailable_reason(p: LogProbProblem) -> str | None:
    """What the kernel cannot take; the input-based refusals first, so they are the same on every device."""
    if isinstance(p.temperature, torch.Tensor):
        return "temperature: verl's kernel takes one float for every row, got a per-row tensor"
    if p.active_rows.numel() != p.num_rows:
        return (
            f"score_mask/ignore_index: verl's kernel scores every row, but {p.num_rows - p.active_rows.numel()} of "
            f"{p.num_rows} rows are left out (score_mask False or label == ignore_index)"
        )
    if p.padded_vocabulary:
        return (
            f"vocab_size: verl's kernel takes no padded vocabulary, got vocab_size={p.vocab_size} below V_local * tp "
            f"size = {p.weight.shape[0] * p.tp_world_size}"
        )
    if p.label_is_max is not None:
        return "return_label_is_max: verl's kernel has no label-is-max output"
    reason = build_unavailable_reason(p.hidden.shape[1], p.hidden.device.type)
    if reason is not None:
        return reason
    try:
        import verl.utils.kernel.linear_cross_entropy  # noqa: F401
    except ImportError as error:
        return f"verl's kernel cannot be imported ({error})"
    return None


def build_unavailable_reason(hidden_size: int, device_type: str) -> str | None:
    if hidden_size % HIDDEN_MULTIPLE:
        return f"hidden: verl's kernel needs H % {HIDDEN_MULTIPLE} == 0, got H={hidden_size}"
    if device_type != "cuda":
        return f"hidden: verl's kernel needs CUDA tensors, got {device_type}"
    if not torch.cuda.is_available():
        return "verl's kernel needs CUDA; none found"
    return None


def run(p: LogProbProblem) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 log-probs and entropy [N] from verl's kernel, called as verl calls it (`hidden` flattened to
    [N, H] as the kernel itself does: same bits); the entropy is dropped when not asked for."""
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    log_probs, entropy = linear_cross_entropy(p.hidden, p.weight, p.labels, p.temperature, "none", p.tp_group)
    return log_probs, entropy if p.calculate_entropy else None
