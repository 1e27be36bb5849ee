"""The Triton passes over materialized fp32 logit chunks (`ops.triton_chunk_kernels`) against fp64 (CUDA only)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _case(rows, columns, seed, offset=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    raw = torch.randn(rows, columns, device="cuda", generator=g) * 4 + offset
    label_col = torch.randint(0, columns, (rows,), device="cuda", generator=g)
    label_col[::3] = -1  # labels held by another tensor-parallel rank
    inv_temp = 1 / (torch.rand(rows, device="cuda", generator=g) + 0.5)
    return raw, label_col, inv_temp, g


@pytest.mark.parametrize("rows,columns,offset", [(7, 5003, 0.0), (64, 151936, 0.0), (33, 4099, -1.0e4)])
def test_chunk_statistics_matches_fp64(rows, columns, offset):
    from verl_fused_hook.ops.triton_chunk_kernels import chunk_statistics

    raw, label_col, inv_temp, _ = _case(rows, columns, seed=rows, offset=offset)
    got = chunk_statistics(raw, label_col, inv_temp)
    z = raw.double() * inv_temp.double().unsqueeze(1)
    row_max = z.max(dim=1).values
    e = torch.exp(z - row_max.unsqueeze(1))
    ref = (row_max, e.sum(1), (e * (z - row_max.unsqueeze(1))).sum(1),
           torch.where(label_col >= 0, z.gather(1, label_col.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0))
    scale = 1 + abs(offset)
    for name, a, b in zip(("max", "sum", "dot", "label"), got, ref):
        tol = 1e-5 * scale * (1 if name in ("max", "label") else b.abs().max().item())
        assert (a.double() - b).abs().max().item() <= tol, name


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_chunk_grad_logits_matches_fp64(out_dtype):
    from verl_fused_hook.ops.triton_chunk_kernels import chunk_grad_logits

    rows, columns = 40, 32003
    raw, label_col, inv_temp, g = _case(rows, columns, seed=5)
    z = raw.double() * inv_temp.double().unsqueeze(1)
    row_max = z.max(dim=1).values
    log_sum = torch.log(torch.exp(z - row_max.unsqueeze(1)).sum(1))
    p = torch.exp(z - row_max.unsqueeze(1) - log_sum.unsqueeze(1))
    mean = (p * z).sum(1)
    g_lp, g_ent = torch.randn(rows, device="cuda", generator=g), torch.randn(rows, device="cuda", generator=g)
    got = chunk_grad_logits(raw, label_col, inv_temp, row_max.float(), log_sum.float(), (mean - row_max).float(),
                            g_lp, g_ent, out_dtype)
    onehot = torch.zeros_like(z)
    has_label = label_col >= 0
    onehot[has_label.nonzero().squeeze(1), label_col[has_label]] = 1.0
    ref = inv_temp.double().unsqueeze(1) * (
        g_lp.double().unsqueeze(1) * (onehot - p) + g_ent.double().unsqueeze(1) * p * (mean.unsqueeze(1) - z))
    assert got.dtype == out_dtype
    rel = 2.0**-8 if out_dtype == torch.bfloat16 else 1e-5
    assert ((got.double() - ref).abs() <= rel * ref.abs() + 1e-6 * ref.abs().max()).all()
