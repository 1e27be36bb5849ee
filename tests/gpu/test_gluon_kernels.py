"""The Gluon ping-pong d_logits kernel (Hopper only) against the Triton kernel it replaces there: same
formula and order of operations, so the same bits. Shapes cover partial tiles in every dimension, H not
a multiple of the K step, a chunk that starts mid-weight, labels in and outside the chunk, and enough
tiles that each program runs both consumers several times (the ping-pong hand-over)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU"
    ),
]


def _kernels():
    from verl_fused_hook.ops.pingpong_choice import pingpong_kernels

    kernels = pingpong_kernels(torch.device("cuda"))
    if kernels is None:
        pytest.skip("this Triton has no Gluon Hopper API (pingpong_choice logs why)")
    return kernels


def _row_args(rows, chunk_start, width, g):
    """Per-row values in the ranges the op feeds: labels in and outside the chunk (-1: another rank's),
    statistics of a real softmax, both upstream gradients random."""
    labels = torch.randint(-1, width, (rows,), device="cuda", generator=g, dtype=torch.int32)
    labels = torch.where(labels >= 0, labels + chunk_start, labels)
    inv_temp = torch.rand(rows, device="cuda", generator=g) + 0.7
    row_max = torch.randn(rows, device="cuda", generator=g)
    log_sum = torch.rand(rows, device="cuda", generator=g) * 8
    shifted_mean = -torch.rand(rows, device="cuda", generator=g) * 3
    g_lp, g_ent = torch.randn(rows, device="cuda", generator=g), torch.randn(rows, device="cuda", generator=g)
    return labels, inv_temp, row_max, log_sum, shifted_mean, g_lp, g_ent


@pytest.mark.parametrize(
    "rows, hidden_size, vocab, chunk_start, width",
    [(777, 520, 1500, 136, 1000), (300, 4096, 9000, 8192, 808), (4096, 2048, 16384, 8192, 8192)],
)
def test_grad_logits_matches_the_triton_kernel_bit_for_bit(rows, hidden_size, vocab, chunk_start, width):
    from triton.tools.tensor_descriptor import TensorDescriptor

    from verl_fused_hook.ops import triton_kernels

    kernels = _kernels()
    g = torch.Generator(device="cuda").manual_seed(rows)
    hidden = torch.randn(rows, hidden_size, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=g) * hidden_size**-0.5).bfloat16()
    row_args = _row_args(rows, chunk_start, width, g)
    ours = torch.full((rows, width), float("nan"), device="cuda", dtype=torch.bfloat16)
    kernels.grad_logits(hidden, kernels.weight_descriptor(weight), ours, row_args, chunk_start)
    theirs = torch.full_like(ours, float("nan"))
    programs = 132
    triton_kernels.grad_logits_kernel[(programs,)](
        TensorDescriptor.from_tensor(hidden, [128, 64]), TensorDescriptor.from_tensor(weight, [256, 64]),
        TensorDescriptor.from_tensor(theirs, [128, 256]), *row_args, rows, hidden_size, chunk_start, width, programs,
        BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3,
    )
    assert not ours.isnan().any()
    assert torch.equal(ours, theirs)


def test_the_backward_uses_it_on_hopper_with_triton_3_6_or_later():
    import triton

    from verl_fused_hook.ops import gluon_kernels
    from verl_fused_hook.ops.pingpong_choice import MIN_TRITON, pingpong_kernels

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < MIN_TRITON:
        pytest.skip(f"Triton {triton.__version__}")
    assert pingpong_kernels(torch.device("cuda")) is gluon_kernels
