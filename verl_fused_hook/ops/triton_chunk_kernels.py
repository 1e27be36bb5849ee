"""Gradient passes over kept logits on CUDA: d_logits formed in place over the logits the forward kernel kept,
for the fused loss and for the two-pass op's rows under keep_logits_bytes.

Why: when the op knows the loss in its forward, each chunk's logits are computed once. The forward
kernel (`triton_kernels.forward_statistics_kernel` with STORE) reduces them to softmax statistics and
also keeps them, as fp16 differences to each tile's row max (`kept_logits.StoredLogits`). Once the
loss's per-row gradients are known, this kernel reads each stored value once and writes d_logits in
the input dtype (bf16/fp16, same size) over it: two bytes read and two written per logit, and no second
buffer. Same arithmetic as `triton_kernels.grad_logits_kernel`: everything relative to the row max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kernels import LOG2E

GRAD_BLOCK = 2048


@triton.jit
def _stored_grad_logits_kernel(
    shifted_ptr, dz_ptr, stride_row, tile_max_ptr, tile_max_stride,
    label_col_ptr, inv_temp_ptr, max_ptr, log_sum_ptr, shifted_mean_ptr, grad_lp_ptr, grad_ent_ptr,
    columns, TILE_N: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per (row, block of columns): dz_j = (g_lp ([j == y] - p_j) + g_H p_j (E[z] - z_j)) / T,
    with z_j / T - max rebuilt as d_j / T + (tile max / T - max): the second term is exactly 0 in the tile
    holding the row max (both scaled with the same rounding), so no precision is lost to large logits."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < columns
    offsets = row.to(tl.int64) * stride_row + cols
    d = tl.load(shifted_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    tile_max = tl.load(tile_max_ptr + row.to(tl.int64) * tile_max_stride + cols // TILE_N, mask=ok, other=0.0)
    label_col = tl.load(label_col_ptr + row)
    inv_temp = tl.load(inv_temp_ptr + row)
    row_max = tl.load(max_ptr + row)
    log_sum2 = tl.load(log_sum_ptr + row) * LOG2E
    shifted_mean = tl.load(shifted_mean_ptr + row)
    g_lp = tl.load(grad_lp_ptr + row) * inv_temp
    g_ent = tl.load(grad_ent_ptr + row) * inv_temp
    shifted = d * inv_temp + (tile_max * inv_temp - row_max)
    p = tl.exp2(shifted * LOG2E - log_sum2)
    dz = p * (g_ent * (shifted_mean - shifted) - g_lp)
    dz = tl.where(cols == label_col, dz + g_lp, dz)
    tl.store(dz_ptr + offsets, dz.to(dz_ptr.dtype.element_ty), mask=ok)


def stored_grad_logits(store, label_col, inv_temp, row_max, log_sum, shifted_mean, g_lp, g_ent,
                       out_dtype: torch.dtype, columns: tuple[int, int] | None = None) -> torch.Tensor:
    """d_logits [R, C] in out_dtype (2 bytes) of sum_i g_lp_i log p_i + g_ent_i H_i with respect to the raw
    logits, written over `store.shifted` (a kept_logits.StoredLogits) and returned
    as a view of it (same strides); only its `columns` [start, stop) when given (start on a tile boundary).
    row_max, log_sum, shifted_mean are the global (tensor-parallel merged) statistics, label_col -1 where
    another rank holds the label."""
    shifted, tile_max = store.shifted, store.tile_max
    if columns is not None:
        start, stop = columns
        if start % store.tile_columns:
            raise ValueError(f"columns: must start on a {store.tile_columns}-column tile boundary, got {start}")
        shifted, tile_max, label_col = shifted[:, start:stop], tile_max[:, start // store.tile_columns :], label_col - start
    if torch.empty((), dtype=out_dtype).element_size() != shifted.element_size():
        raise ValueError(f"out_dtype: must be a 2-byte float to overwrite the stored logits, got {out_dtype}")
    rows, width = shifted.shape
    dz = shifted.view(out_dtype)
    if rows and width:
        vectors = [t.float().contiguous() for t in (inv_temp, row_max, log_sum, shifted_mean, g_lp, g_ent)]
        _stored_grad_logits_kernel[(rows, triton.cdiv(width, GRAD_BLOCK))](
            shifted, dz, shifted.stride(0), tile_max, tile_max.stride(0),
            label_col.to(torch.int64).contiguous(), *vectors,
            width, TILE_N=store.tile_columns, BLOCK=GRAD_BLOCK, num_warps=8,
        )
    return dz


def kept_gradients(store, block, weight: torch.Tensor, row_max, log_sum, shifted_mean, g_lp, g_ent, want_hidden: bool,
                   weight_sum) -> torch.Tensor | None:
    """The two-pass op's backward when every scored row's logits were kept (keep_logits_bytes): d_logits over all
    of them in place, then one GEMM for the block's d_weight (into weight_sum, a WeightGradientSum) and one for
    its d_hidden (the sum over the vocabulary in cuBLAS's fp32, rounded once: no accumulator, no chunks)."""
    dz = stored_grad_logits(store, block.label_col, block.inv_temp, row_max, log_sum, shifted_mean, g_lp, g_ent,
                            block.hidden.dtype)
    if weight_sum is not None:
        weight_sum.add(dz, block.hidden)
    return torch.mm(dz, weight) if want_hidden else None
