"""Fused Triton backend for CUDA (Hopper first): logits never reach memory in the forward,
and the backward recomputes them one vocabulary chunk at a time.

Forward: one kernel reduces each scored row's logits, tile by tile, to softmax
statistics; the vocabulary is split across programs when rows are few, and the
splits are merged here with the same shifted formulas as statistics.py.
Backward: per vocabulary chunk, a kernel recomputes the logits and writes
d_logits (bf16); two cuBLAS GEMMs then give that chunk's complete d_weight rows
and add its share of d_hidden into an fp32 accumulator. The chunk is sized so
the extra memory stays under EXTRA_MEMORY_BUDGET. No float atomics anywhere, so
two runs give the same bits.
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

# Extra memory the backward may hold at once (fp32 d_hidden accumulator + d_logits chunk).
EXTRA_MEMORY_BUDGET = 960 * 1024 * 1024
# Wider d_logits chunks cut the fp32 accumulator's traffic (read+write once per chunk) but
# cost 2 bytes per row and column; 4608 columns keep the extra memory near 4H + 9 KiB per row.
MAX_CHUNK_COLUMNS = 4608
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


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
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
    hidden = _tma_ready(p.hidden if all_rows else p.hidden.index_select(0, rows))
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


def _local_statistics(p: LogProbProblem, hidden, weight, label_col, inv_temp):
    """This rank's (max, sum, shifted dot, label logit) per scored row, from the fused kernel."""
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
        n, hidden.shape[1], p.valid_columns, col_tiles, per, splits,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        ENTROPY=p.calculate_entropy, num_warps=c.num_warps, num_stages=c.num_stages,
    )
    if splits == 1:
        return parts[0, 0], parts[1, 0], parts[2, 0], parts[3, 0]
    return _merge_splits(*parts.unbind(0))


def _forward(p: LogProbProblem):
    weight = _tma_ready(p.weight)
    hidden, label_col, inv_temp = _row_inputs(p)
    stats = _local_statistics(p, hidden, weight, label_col, inv_temp)
    log_probs, entropy, row_max, log_sum, shifted_mean = combine_row_statistics(p, *stats)
    return log_probs, entropy, row_max, log_sum, shifted_mean, (hidden, weight, label_col, inv_temp)


def chunk_columns(rows: int, hidden_size: int, valid_columns: int, block_n: int) -> int:
    """Vocabulary columns per backward chunk: the widest multiple of block_n up to
    MAX_CHUNK_COLUMNS whose bf16 d_logits fit beside the fp32 d_hidden accumulator
    inside EXTRA_MEMORY_BUDGET."""
    left = max(EXTRA_MEMORY_BUDGET - 4 * rows * hidden_size, 0)
    width = min(left // (2 * max(rows, 1)), MAX_CHUNK_COLUMNS) // block_n * block_n
    return max(block_n, min(width, -(-valid_columns // block_n) * block_n))


def _backward(saved, valid_columns: int, grad_lp, grad_ent, want_hidden: bool, d_weight):
    """fp32 d_hidden over the scored rows (or None); fills d_weight[:valid_columns] when given."""
    from . import triton_kernels as kernels

    hidden, weight, label_col, inv_temp, row_max, log_sum, shifted_mean = saved
    n, h = hidden.shape
    c = GRAD_CONFIG
    width = chunk_columns(n, h, valid_columns, c.block_n)
    dz_buffer = torch.empty(n, width, dtype=hidden.dtype, device=hidden.device)
    d_hidden = torch.zeros(n, h, dtype=torch.float32, device=hidden.device) if want_hidden else None
    h_desc = _descriptor(hidden, [c.block_m, c.block_k])
    w_desc = _descriptor(weight[:valid_columns], [c.block_n, c.block_k])
    row_blocks = -(-n // c.block_m)
    for start in range(0, valid_columns, width):
        cols = min(width, valid_columns - start)
        dz = dz_buffer[:, :cols]
        kernels.grad_logits_kernel[(row_blocks * -(-cols // c.block_n),)](
            h_desc, w_desc, _descriptor(dz, [c.block_m, c.block_n]),
            label_col, inv_temp, row_max, log_sum, shifted_mean, grad_lp, grad_ent,
            n, h, start, cols,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )
        if d_hidden is not None:
            torch.addmm(d_hidden, dz, weight[start : start + cols], out_dtype=torch.float32, out=d_hidden)
        if d_weight is not None:
            torch.mm(dz.t(), hidden, out=d_weight[start : start + cols])
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
