"""Run verl's legacy fused forward on a machine without CUDA, and with the TP sum verl's forward lacks (A/B runs,
benchmarks and CPU tests only).

STAND-INS, named as such, for the kernel verl's legacy `_fused_GPTModel_forward`
looks up at call time (`model_forward_fused.linear_cross_entropy`):
- `portable_legacy_kernel`: verl's Triton kernel asserts CUDA tensors, so for a
  CPU run where both sides must compute with one kernel, the portable op with
  the same contract (flattened rows, one float temperature, every row and
  column, the TP group's partial hidden gradient);
- `legacy_kernel_with_tp_sum`: whatever kernel is in place, its hidden input
  passed through megatron's copy-to-TP-region, whose backward all-reduces the
  hidden gradient over the TP group: the sum verl's forward misses with TP > 1
  and sequence parallelism off. ab-parity runs it to show that sum is the only
  difference to hook mode.
Each restores verl's attribute on exit.
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
def _legacy_kernel_replaced(make_kernel):
    """verl's legacy kernel attribute set to make_kernel(the kernel in place) within the block."""
    from verl.models.mcore import model_forward_fused  # verl loads only where its forward runs

    previous = model_forward_fused.linear_cross_entropy
    model_forward_fused.linear_cross_entropy = make_kernel(previous)
    try:
        yield
    finally:
        model_forward_fused.linear_cross_entropy = previous


def portable_legacy_kernel(backend: str = "torch"):
    """Within the block, verl's legacy fused forward computes with the op's `backend` instead of Triton."""

    def make_kernel(_verl_kernel):
        return lambda *args, **kwargs: portable_linear_cross_entropy(*args, **kwargs, backend=backend)

    return _legacy_kernel_replaced(make_kernel)


def portable_legacy_kernel_on_cpu(device: str, backend: str = "torch"):
    """`portable_legacy_kernel(backend)` when `device` is the CPU (where verl's Triton kernel cannot run);
    nothing on CUDA."""
    return portable_legacy_kernel(backend) if device == "cpu" else contextlib.nullcontext()


def legacy_kernel_with_tp_sum():
    """Within the block, verl's legacy kernel (whichever is in place) gets its hidden input through megatron's
    copy-to-TP-region: the hidden gradient is summed over the TP group."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

    def make_kernel(kernel):
        return lambda hidden, *rest: kernel(copy_to_tensor_model_parallel_region(hidden), *rest)

    return _legacy_kernel_replaced(make_kernel)
