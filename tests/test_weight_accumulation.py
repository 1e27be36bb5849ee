"""What the loss-inside op's fp32 d_weight accumulator buys (CPU, against fp64): measured for results/EXPERIMENTS.md.

With more than one chunk, d_weight is a sum of one GEMM per chunk; the op adds them in an fp32 buffer
(V_local x H x 4 bytes) and rounds once into the bf16 d_weight (weight_gradient.py). Alternatives that spare
that buffer, simulated here with the GPU's arithmetic (bf16 d_logits and hidden rows, fp32 GEMM accumulation):
- "bf16": each chunk's product added straight into the bf16 d_weight (cuBLAS addmm, beta=1: one rounding to
  bf16 per chunk);
- "bf16 pair": d_weight itself as the high part plus a bf16 low part (V_local x H x 2 bytes, half the buffer),
  each chunk's fp32 product added into hi + lo and split again (one elementwise pass per chunk).
Errors are relative (Frobenius) against the fp64 gradient of the same loss on the same bf16 inputs.
"""

from __future__ import annotations

import pytest
import torch

N, H, V = 4096, 256, 2048
CHUNKS = (1, 2, 4, 8, 16)


def _inputs():
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(N, H, generator=g).bfloat16()
    weight = (torch.randn(V, H, generator=g) * H**-0.5 * 3).bfloat16()
    labels = torch.randint(0, V, (N,), generator=g)
    g_lp = torch.randn(N, generator=g) / N
    return hidden, weight, labels, g_lp


def _d_logits(hidden, weight, labels, g_lp, dtype):
    """d(sum g_lp log p_label)/d logits: p_j (-g_lp) + g_lp [j = label]."""
    logits = hidden.to(dtype) @ weight.to(dtype).t()
    d = -torch.softmax(logits, dim=1) * g_lp.to(dtype).unsqueeze(1)
    return d.scatter_add_(1, labels.unsqueeze(1), g_lp.to(dtype).unsqueeze(1))


def accumulation_errors() -> dict[str, dict[int, float]]:
    hidden, weight, labels, g_lp = _inputs()
    exact = _d_logits(hidden, weight, labels, g_lp, torch.float64).t() @ hidden.double()
    dz = _d_logits(hidden, weight, labels, g_lp, torch.float32).bfloat16()  # as the kernels round it
    errors: dict[str, dict[int, float]] = {"fp32": {}, "bf16": {}, "bf16 pair": {}}
    for chunks in CHUNKS:
        products = [a.float().t() @ b.float() for a, b in zip(dz.chunk(chunks), hidden.chunk(chunks))]
        total = torch.zeros(V, H)
        hi = torch.zeros(V, H, dtype=torch.bfloat16)
        lo = torch.zeros(V, H, dtype=torch.bfloat16)
        plain = torch.zeros(V, H, dtype=torch.bfloat16)
        for product in products:
            total += product
            plain = (plain.float() + product).bfloat16()
            s = hi.float() + lo.float() + product
            hi = s.bfloat16()
            lo = (s - hi.float()).bfloat16()
        for name, result in (("fp32", total.bfloat16()), ("bf16", plain), ("bf16 pair", hi)):
            errors[name][chunks] = ((result.double() - exact).norm() / exact.norm()).item()
    return errors


def test_the_fp32_accumulator_against_bf16_accumulation():
    errors = accumulation_errors()
    print("d_weight relative error vs fp64, by chunk count:", errors)
    # fp32: the bf16 rounding of d_logits and of the result, whatever the chunk count
    assert max(errors["fp32"].values()) <= 1.05 * errors["fp32"][1]
    # bf16: one more rounding per chunk; grows with the chunk count
    assert errors["bf16"][1] == errors["fp32"][1]
    assert errors["bf16"][4] > 1.2 * errors["fp32"][4] and errors["bf16"][16] > errors["bf16"][4]
    # a bf16 pair (16 significant bits) is as good as fp32 here
    for chunks in CHUNKS:
        assert errors["bf16 pair"][chunks] == pytest.approx(errors["fp32"][chunks], rel=0.02)
