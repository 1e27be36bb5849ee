"""Fused Triton backend for CUDA (Hopper first): logits never reach memory in the forward,
and the backward recomputes them one vocabulary chunk at a time.

Forward: one kernel reduces each scored row's logits, tile by tile, to softmax
statistics; the vocabulary is split across programs when rows are few, and the
splits are merged here with the same shifted formulas as statistics.py.
Backward: per vocabulary chunk and tile of rows, a kernel recomputes the logits and writes
d_logits (bf16); two cuBLAS GEMMs then add that tile's share of d_hidden into an fp32
accumulator and of the chunk's d_weight rows. Chunk width and tile height come from fixed
budgets, not from the token count, so the time per row does not change with N. The fp32
d_hidden accumulator (4 bytes per scored row and hidden unit) is the one buffer that grows
with N: it keeps d_hidden a sum of fp32 partials over the vocabulary, rounded once. No
float atomics anywhere, so two runs give the same bits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .precision import fp32_backward
from .problem import LogProbProblem
from .statistics import combine_row_statistics, rescale_partials, scatter_rows

# Working memory of the backward beside the fp32 d_hidden accumulator: the bf16 d_logits tile and, when the
# rows need more than one tile, the fp32 accumulator of the chunk's d_weight rows.
TILE_MEMORY_BUDGET = 1024 * 1024 * 1024
# Vocabulary columns per backward chunk. The fp32 d_hidden accumulator is read and written once per chunk:
# 8 bytes per row and hidden unit against 2 * CHUNK_COLUMNS flops of the chunk's products, far below
# what those take (Hopper's balance is ~165 flops per byte; 8192 columns give 2048).
CHUNK_COLUMNS = 8192
# Each split pays a prologue and a partial-statistics store, worth about this many column tiles.
SPLIT_OVERHEAD_TILES = 0.5
# Programs running together should share few row blocks (kept in L2) and stream a few vocabulary
# splits; with a single split, 132 programs would each stream their own 1 MiB row block per tile.
MIN_SPLITS = 8


@dataclass(frozen=True)
class TileConfig:
    """Block shape and pipelining of one kernel launch; ctas_per_sm feeds the wave arithmetic."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int


FORWARD_CONFIG = TileConfig(block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3, ctas_per_sm=1)
# Two 4-warp programs per SM: one's d_logits epilogue overlaps the other's matrix products.
GRAD_CONFIG = TileConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=3, ctas_per_sm=2)


def unavailable_reason(p: LogProbProblem) -> str | None:
    """None when this backend can run `p`, else why not (auto logs it and falls back)."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if p.hidden.device.type != "cuda":
        return f"hidden is on {p.hidden.device.type}"
    if torch.cuda.get_device_capability(p.hidden.device)[0] < 9:
        return "needs a Hopper or newer GPU (TMA descriptors)"
    if p.hidden.dtype != torch.bfloat16 or p.weight.dtype != torch.bfloat16:
        return f"hidden/weight must both be bfloat16, got {p.hidden.dtype} and {p.weight.dtype}"
    if p.hidden.shape[1] % 8 != 0:
        return f"H={p.hidden.shape[1]} not supported (TMA needs rows of a multiple of 8 bf16 elements)"
    return None


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """Row-major with a 16-byte aligned base, as TMA descriptors require (copies only if not)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return out.copy_(t)


def _descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=1024)  # host time before the launch is GPU idle time
def choose_tiles_per_split(row_blocks: int, col_tiles: int, slots: int) -> int:
    """Column tiles per program minimizing (waves x tiles per program), with at least
    MIN_SPLITS splits when there are that many tiles (L2 locality, see MIN_SPLITS)."""
    best, best_cost = 1, math.inf
    for per in range(1, -(-col_tiles // min(MIN_SPLITS, col_tiles)) + 1):
        splits = -(-col_tiles // per)
        if splits * per - col_tiles >= per:  # an empty last split: same as a smaller `per`
            continue
        waves = -(-(row_blocks * splits) // slots)
        cost = waves * (per + SPLIT_OVERHEAD_TILES)
        if cost < best_cost:
            best, best_cost = per, cost
    return best


def _row_inputs(p: LogProbProblem):
    """Compacted scored rows: hidden, label column in this shard (-1 elsewhere), 1/temperature."""
    rows = p.active_rows
    all_rows = rows.numel() == p.num_rows
    hidden = tma_ready(p.hidden if all_rows else p.hidden.index_select(0, rows))
    local = p.labels.index_select(0, rows) - p.vocab_start
    label_col = torch.where((local >= 0) & (local < p.valid_columns), local, -1).to(torch.int32)
    if isinstance(p.temperature, torch.Tensor):
        inv_temp = p.temperature.index_select(0, rows).reciprocal()
    else:
        inv_temp = torch.full((rows.numel(),), 1.0 / p.temperature, dtype=torch.float32, device=rows.device)
    return hidden, label_col, inv_temp


def _merge_splits(part_max, part_sum, part_dot, part_label):
    """Combine [splits, rows] partial statistics into one per row."""
    row_max = part_max.amax(dim=0)
    total, dot = rescale_partials(row_max, part_max, part_sum, part_dot)
    return row_max, total.sum(dim=0), dot.sum(dim=0), part_label.sum(dim=0)


@dataclass(frozen=True)
class StoredLogits:
    """Where the forward kernel keeps a chunk's logits for the fused loss's gradient pass: `shifted`,
    fp16 [rows, valid_columns] (row stride a multiple of 8 elements), each FORWARD_CONFIG.block_n-wide
    tile relative to its own row max, and that max, fp32 [rows, column tiles]."""

    shifted: torch.Tensor
    tile_max: torch.Tensor


def local_statistics(p: LogProbProblem, hidden, weight, label_col, inv_temp, store: StoredLogits | None = None):
    """This rank's (max, sum, shifted dot, label logit) per row of `hidden` (the scored rows, compacted),
    from the fused kernel; with `store`, the kernel also writes the logits there."""
    from . import triton_kernels as kernels

    n = hidden.shape[0]
    if p.valid_columns == 0 or n == 0:
        device = hidden.device
        return (torch.full((n,), float("-inf"), device=device), torch.zeros(n, device=device),
                torch.zeros(n, device=device), torch.zeros(n, device=device))
    c = FORWARD_CONFIG
    row_blocks = -(-n // c.block_m)
    col_tiles = -(-p.valid_columns // c.block_n)
    per = choose_tiles_per_split(row_blocks, col_tiles, _num_sms(hidden.device) * c.ctas_per_sm)
    splits = -(-col_tiles // per)
    parts = torch.empty(4, splits, n, dtype=torch.float32, device=hidden.device)
    kernels.forward_statistics_kernel[(row_blocks * splits,)](
        _descriptor(hidden, [c.block_m, c.block_k]),
        _descriptor(weight[: p.valid_columns], [c.block_n, c.block_k]),
        label_col, inv_temp, parts[0], parts[1], parts[2], parts[3],
        None if store is None else _descriptor(store.shifted, [c.block_m, c.block_n]),
        None if store is None else store.tile_max,
        n, hidden.shape[1], p.valid_columns, col_tiles, per, splits,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        ENTROPY=p.calculate_entropy, STORE=store is not None, num_warps=c.num_warps, num_stages=c.num_stages,
    )
    if splits == 1:
        return parts[0, 0], parts[1, 0], parts[2, 0], parts[3, 0]
    return _merge_splits(*parts.unbind(0))


def _forward(p: LogProbProblem):
    weight = tma_ready(p.weight)
    hidden, label_col, inv_temp = _row_inputs(p)
    stats = local_statistics(p, hidden, weight, label_col, inv_temp)
    log_probs, entropy, row_max, log_sum, shifted_mean = combine_row_statistics(p, *stats)
    return log_probs, entropy, row_max, log_sum, shifted_mean, (hidden, weight, label_col, inv_temp)


@dataclass(frozen=True)
class BackwardTiling:
    """How the backward walks [rows x vocabulary]: `columns` per chunk, `rows` per d_logits tile."""

    columns: int
    rows: int

    def tiles(self, total_rows: int) -> list[tuple[int, int]]:
        return [(start, min(self.rows, total_rows - start)) for start in range(0, total_rows, self.rows)]


def backward_tiling(rows: int, hidden_size: int, valid_columns: int, block_m: int, block_n: int) -> BackwardTiling:
    """Chunks of CHUNK_COLUMNS (fewer when the shard is narrower); all rows in one d_logits tile when it fits
    TILE_MEMORY_BUDGET, else equal tiles of whole row blocks that fit it beside the chunk's fp32 d_weight
    accumulator. Neither depends on anything but budgets and shapes, so the work per row is the same at every N."""
    columns = min(CHUNK_COLUMNS, -(-valid_columns // block_n) * block_n)
    rows = max(rows, 1)
    if 2 * rows * columns <= TILE_MEMORY_BUDGET:
        return BackwardTiling(columns, rows)
    fit = max(block_m, (TILE_MEMORY_BUDGET - 4 * columns * hidden_size) // (2 * columns) // block_m * block_m)
    balanced = -(-rows // -(-rows // fit))  # as many rows in every tile as the tile count allows
    return BackwardTiling(columns, -(-balanced // block_m) * block_m)


def _backward(saved, valid_columns: int, grad_lp, grad_ent, want_hidden: bool, d_weight):
    """fp32 d_hidden over the scored rows (or None); fills d_weight[:valid_columns] when given."""
    from . import triton_kernels as kernels

    hidden, weight, label_col, inv_temp, row_max, log_sum, shifted_mean = saved
    n, h = hidden.shape
    c = GRAD_CONFIG
    tiling = backward_tiling(n, h, valid_columns, c.block_m, c.block_n)
    tiles = tiling.tiles(n)
    dz_buffer = torch.empty(tiling.rows, tiling.columns, dtype=hidden.dtype, device=hidden.device)
    d_hidden = torch.zeros(n, h, dtype=torch.float32, device=hidden.device) if want_hidden else None
    # Several row tiles add into a chunk's d_weight rows: in fp32, rounded once into d_weight.
    dw_chunk = None
    if d_weight is not None and len(tiles) > 1:
        dw_chunk = torch.empty(tiling.columns, h, dtype=torch.float32, device=hidden.device)
    w_desc = _descriptor(weight[:valid_columns], [c.block_n, c.block_k])
    row_args = (label_col, inv_temp, row_max, log_sum, shifted_mean, grad_lp, grad_ent)
    for start in range(0, valid_columns, tiling.columns):
        cols = min(tiling.columns, valid_columns - start)
        w_chunk = weight[start : start + cols]
        for index, (first, count) in enumerate(tiles):
            rows = slice(first, first + count)
            dz = dz_buffer[:count, :cols]
            kernels.grad_logits_kernel[(-(-count // c.block_m) * -(-cols // c.block_n),)](
                _descriptor(hidden[rows], [c.block_m, c.block_k]), w_desc, _descriptor(dz, [c.block_m, c.block_n]),
                *(t[rows] for t in row_args),
                count, h, start, cols,
                BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
                num_warps=c.num_warps, num_stages=c.num_stages,
            )
            if d_hidden is not None:
                torch.addmm(d_hidden[rows], dz, w_chunk, out_dtype=torch.float32, out=d_hidden[rows])
            if dw_chunk is None:
                if d_weight is not None:
                    torch.mm(dz.t(), hidden[rows], out=d_weight[start : start + cols])
            else:  # beta=0 on the first tile: the buffer's old contents are ignored, NaN included
                accumulate = dw_chunk[:cols]
                torch.addmm(accumulate, dz.t(), hidden[rows], beta=min(index, 1), out_dtype=torch.float32, out=accumulate)
        if dw_chunk is not None:
            d_weight[start : start + cols].copy_(dw_chunk[:cols])
    return d_hidden


class _FusedLogProbEntropy(torch.autograd.Function):
    """Saves the compacted inputs plus three fp32 numbers per scored row (max, log sum-exp and
    mean logit, both relative to the max)."""

    @staticmethod
    def forward(ctx, hidden, weight, p: LogProbProblem):
        log_probs, entropy, row_max, log_sum, shifted_mean, inputs = _forward(p)
        ctx.save_for_backward(*inputs, row_max, log_sum, shifted_mean, p.active_rows)
        ctx.layout = (p.valid_columns, p.num_rows, p.calculate_entropy)
        ctx.set_materialize_grads(False)
        return scatter_rows(p, log_probs), scatter_rows(p, entropy)

    @staticmethod
    @once_differentiable  # second-order gradients are not implemented: raise, never return wrong ones
    @fp32_backward
    def backward(ctx, grad_log_probs, grad_entropy):
        *saved, active_rows = ctx.saved_tensors
        valid_columns, num_rows, calculate_entropy = ctx.layout
        hidden, weight = saved[0], saved[1]
        if not calculate_entropy:
            grad_entropy = None
        n = active_rows.numel()
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_hidden = torch.zeros(num_rows, hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        if ctx.needs_input_grad[1]:
            grad_weight = torch.empty_like(weight)
            grad_weight[valid_columns:].zero_()
        if valid_columns == 0 or n == 0 or (grad_log_probs is None and grad_entropy is None):
            if grad_weight is not None:
                grad_weight.zero_()
            return grad_hidden, grad_weight, None

        def rows_of(grad):
            if grad is None:
                return torch.zeros(n, dtype=torch.float32, device=hidden.device)
            return grad.index_select(0, active_rows).float()

        d_hidden = _backward(
            saved, valid_columns, rows_of(grad_log_probs), rows_of(grad_entropy), grad_hidden is not None, grad_weight
        )
        if d_hidden is not None:
            if n == num_rows:
                grad_hidden.copy_(d_hidden)
            else:
                grad_hidden.index_copy_(0, active_rows, d_hidden.to(hidden.dtype))
        return grad_hidden, grad_weight, None


def run(p: LogProbProblem) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropy for `p`; differentiable in hidden and weight when they require grad."""
    if not p.needs_grad:
        with torch.no_grad():
            log_probs, entropy, *_ = _forward(p)
        return scatter_rows(p, log_probs), scatter_rows(p, entropy)
    return _FusedLogProbEntropy.apply(p.hidden, p.weight, p)
