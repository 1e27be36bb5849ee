"""Run verl's legacy fused forward on a machine without CUDA (A/B runs and CPU tests only).

Why: verl's legacy `_fused_GPTModel_forward` calls its Triton kernel, which
asserts CUDA tensors. For a CPU A/B run both sides must use one kernel, so
while this context is active the legacy forward's kernel (looked up as
`model_forward_fused.linear_cross_entropy` at call time) is the portable op
with the same contract: flattened rows, one float temperature, every row and
column, the TP group's partial hidden gradient.
"""

from __future__ import annotations

import contextlib

from verl_fused_hook.ops import log_probs_and_entropy


def portable_linear_cross_entropy(
    hidden, weight, labels, temperature, reduction="none", dist_process_group=None, *, backend="torch"
):
    """verl's `linear_cross_entropy(hidden, weight, labels, temperature, reduction, tp_group)` on the op."""
    if reduction != "none":
        raise ValueError(f"reduction: only 'none' is used by verl's fused forward, got {reduction!r}")
    return log_probs_and_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        labels.reshape(-1),
        temperature=temperature,
        tp_group=dist_process_group,
        tp_hidden="partial",  # verl's kernel returns each rank's partial d_hidden; verl's forward never sums it
        backend=backend,
    )


@contextlib.contextmanager
def portable_legacy_kernel(backend: str = "torch"):
    """Within the block, verl's legacy fused forward computes with the op's `backend` instead of Triton."""
    from verl.models.mcore import model_forward_fused

    verl_kernel = model_forward_fused.linear_cross_entropy

    def kernel(*args, **kwargs):
        return portable_linear_cross_entropy(*args, **kwargs, backend=backend)

    model_forward_fused.linear_cross_entropy = kernel
    try:
        yield
    finally:
        model_forward_fused.linear_cross_entropy = verl_kernel
