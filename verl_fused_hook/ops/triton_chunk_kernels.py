"""Triton versions of the two elementwise passes over a chunk of materialized fp32 logits (CUDA).

Why: when the op knows the loss in its forward, each chunk's logits are computed once by cuBLAS and kept
in fp32 while the chunk's statistics and d_logits are formed. Done with torch ops those two steps are
about ten passes over the chunk; these kernels make them two reads and one write. Same signatures and
conventions as `chunk_elementwise` (the portable versions), same arithmetic as `triton_kernels`: the
running max is kept on raw dot products, exponents in base 2, everything relative to the row max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import LN2, LOG2E, NEG

STATISTICS_BLOCK = 2048
GRAD_BLOCK = 2048


@triton.jit
def _chunk_statistics_kernel(
    raw_ptr, stride_row, label_col_ptr, inv_temp_ptr,
    max_ptr, sum_ptr, dot_ptr, label_ptr,
    columns, BLOCK: tl.constexpr,
):
    """One program per row: online (max, sum, shifted dot, label logit) over the row's columns."""
    row = tl.program_id(0)
    base = raw_ptr + row.to(tl.int64) * stride_row
    label_col = tl.load(label_col_ptr + row)
    inv_temp = tl.load(inv_temp_ptr + row)
    scale = inv_temp * LOG2E
    run_max = -1.0e30  # NEG: finite, so the first rescale is exp2(-huge) = 0, never inf * 0
    run_sum = 0.0
    run_dot = 0.0
    label_raw = 0.0
    for start in range(0, columns, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < columns, other=NEG)
        label_raw += tl.sum(tl.where(cols == label_col, x, 0.0))
        new_max = tl.maximum(run_max, tl.max(x))
        shift = (run_max - new_max) * scale
        rescale = tl.exp2(shift)
        shifted = (x - new_max) * scale
        e = tl.exp2(shifted)
        run_dot = rescale * (run_dot + shift * run_sum) + tl.sum(e * shifted)
        run_sum = run_sum * rescale + tl.sum(e)
        run_max = new_max
    tl.store(max_ptr + row, run_max * inv_temp)
    tl.store(sum_ptr + row, run_sum)
    tl.store(dot_ptr + row, run_dot * LN2)
    tl.store(label_ptr + row, label_raw * inv_temp)


@triton.jit
def _chunk_grad_logits_kernel(
    raw_ptr, stride_row, out_ptr, stride_out, label_col_ptr, inv_temp_ptr,
    max_ptr, log_sum_ptr, shifted_mean_ptr, grad_lp_ptr, grad_ent_ptr,
    columns, BLOCK: tl.constexpr,
):
    """One program per (row, block of columns): dz_j = (g_lp ([j == y] - p_j) + g_H p_j (E[z] - z_j)) / T."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < columns
    x = tl.load(raw_ptr + row.to(tl.int64) * stride_row + cols, mask=ok, other=0.0)
    label_col = tl.load(label_col_ptr + row)
    inv_temp = tl.load(inv_temp_ptr + row)
    row_max = tl.load(max_ptr + row)
    log_sum2 = tl.load(log_sum_ptr + row) * LOG2E
    shifted_mean = tl.load(shifted_mean_ptr + row)
    g_lp = tl.load(grad_lp_ptr + row) * inv_temp
    g_ent = tl.load(grad_ent_ptr + row) * inv_temp
    shifted = x * inv_temp - row_max
    p = tl.exp2(shifted * LOG2E - log_sum2)
    dz = p * (g_ent * (shifted_mean - shifted) - g_lp)
    dz = tl.where(cols == label_col, dz + g_lp, dz)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, dz.to(out_ptr.dtype.element_ty), mask=ok)


def _row_major(raw: torch.Tensor) -> torch.Tensor:
    return raw if raw.stride(1) == 1 else raw.contiguous()


def chunk_statistics(raw: torch.Tensor, label_col: torch.Tensor, inv_temp: torch.Tensor):
    """fp32 [R] each: max_j z_j, sum_j e^(z_j - max), sum_j e^(z_j - max)(z_j - max), z at label_col (0 where
    -1), with z = raw * inv_temp; raw is fp32 [R, C] (valid columns only)."""
    raw = _row_major(raw)
    rows, columns = raw.shape
    out = torch.empty(4, rows, dtype=torch.float32, device=raw.device)
    if rows:
        _chunk_statistics_kernel[(rows,)](
            raw, raw.stride(0), label_col.to(torch.int64).contiguous(), inv_temp.float().contiguous(),
            out[0], out[1], out[2], out[3], columns, BLOCK=STATISTICS_BLOCK, num_warps=8,
        )
    return out[0], out[1], out[2], out[3]


def chunk_grad_logits(raw, label_col, inv_temp, row_max, log_sum, shifted_mean, g_lp, g_ent, out_dtype):
    """d_logits [R, C] in out_dtype of sum_i g_lp_i log p_i + g_ent_i H_i with respect to the raw logits,
    given the global (tensor-parallel merged) row statistics."""
    raw = _row_major(raw)
    rows, columns = raw.shape
    out = torch.empty(rows, columns, dtype=out_dtype, device=raw.device)
    if rows and columns:
        vectors = [t.float().contiguous() for t in (inv_temp, row_max, log_sum, shifted_mean, g_lp, g_ent)]
        _chunk_grad_logits_kernel[(rows, triton.cdiv(columns, GRAD_BLOCK))](
            raw, raw.stride(0), out, out.stride(0), label_col.to(torch.int64).contiguous(), *vectors,
            columns, BLOCK=GRAD_BLOCK, num_warps=8,
        )
    return out
