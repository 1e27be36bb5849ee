"""Fused Triton backend for CUDA (Hopper first): logits never reach memory in the forward,
and the backward recomputes them one vocabulary chunk at a time (triton_recompute.py).

Two-pass op (`RecomputingPasses`): every scored row is one block in the forward; its kernels tile rows
and vocabulary themselves. Statistics: one kernel reduces each scored row's logits, tile by tile,
to a Partial; the vocabulary is split across programs when rows are few, and the splits are
merged with softmax_math's formulas. Gradients: triton_recompute.py, over every row at once or, where that
needs less memory, over groups of rows (`row_groups`). With keep_logits_bytes the forward kernel also keeps
some rows' logits, and those skip the recompute.
Loss-inside op (`StoredLogitsPasses`): the chunks chunking.py plans from this backend's
`loss_inside_cost`; the statistics kernel also keeps the logits in fp16, and the gradient pass
overwrites them in place with d_logits (triton_chunk_kernels.py). No float atomics anywhere, so two runs give the same bits.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from . import triton_launch as launch
from .chunking import ChunkCost
from .kept_logits import StoredLogits, kept_rows_buffer, stored_layout
from .problem import LogProbProblem, RowBlock
from .softmax_math import inverse_temperature, label_columns, merge_partials, no_column_partials
from .triton_recompute import recomputed_gradients, row_groups
from .weight_gradient import WeightGradientSum

# Each split pays a prologue and a partial-statistics store, worth about this many column tiles.
SPLIT_OVERHEAD_TILES = 0.5
# Programs running together share few row blocks (kept in L2) and stream a few vocabulary splits; with one
# split, 132 programs would each stream their own 1 MiB row block per tile.
MIN_SPLITS = 8
# The loss-inside op's chunk of stored logits (fp16, then d_logits in place). More rows per chunk add fewer times
# into the fp32 d_weight accumulator (V_local x H x 4 bytes; none with one chunk) and leave more GPU work queued
# behind loss_fn's final host evaluation (~21 ms for verl's ppo_loss at 65k tokens). H200, 65536 x 2048 x 151936:
# 4 GiB (5 chunks) 0.84x the 4-GEMM floor, 2 GiB (10 chunks) 0.885x.
STORED_CHUNK_BUDGET_BYTES = 4 * 1024**3

FORWARD_CONFIG = launch.TileConfig(block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3, ctas_per_sm=1)


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
    return _triton_import_error()


def build_unavailable_reason(hidden_size: int, device_type: str) -> str | None:
    """What can be known at model build: the device, the GPU generation, Triton, H."""
    if device_type != "cuda":
        return f"needs CUDA; the model is on {device_type}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if torch.cuda.get_device_capability()[0] < 9:
        return "needs a Hopper or newer GPU (TMA descriptors)"
    if hidden_size % 8 != 0:
        return f"H={hidden_size} not supported (TMA needs rows of a multiple of 8 bf16 elements)"
    return _triton_import_error()


def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401  (after the first call a dictionary lookup)
    except ImportError as error:
        return f"Triton cannot be imported ({error})"
    return None


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


def _block(p: LogProbProblem, rows: Tensor, span: slice) -> RowBlock:
    """Scored rows compacted (unless they are every row) and TMA-ready, label column as int32."""
    hidden = launch.tma_ready(p.hidden if rows.numel() == p.num_rows else p.hidden.index_select(0, rows))
    return RowBlock(span, rows, hidden, label_columns(p, rows).to(torch.int32), inverse_temperature(p.temperature, rows))


def local_statistics(p: LogProbProblem, hidden, weight, label_col, inv_temp, store: StoredLogits | None = None):
    """This rank's (max, sum, shifted dot, label logit) per row of `hidden` (the scored rows, compacted),
    from the fused kernel; with `store`, the kernel also writes the logits there."""
    from . import triton_kernels as kernels

    n = hidden.shape[0]
    if p.valid_columns == 0 or n == 0:
        return no_column_partials(n, hidden.device)
    c = FORWARD_CONFIG
    row_blocks = -(-n // c.block_m)
    col_tiles = -(-p.valid_columns // c.block_n)
    per = choose_tiles_per_split(row_blocks, col_tiles, launch.num_sms(hidden.device) * c.ctas_per_sm)
    splits = -(-col_tiles // per)
    parts = torch.empty(4, splits, n, dtype=torch.float32, device=hidden.device)
    kernels.forward_statistics_kernel[(row_blocks * splits,)](
        launch.descriptor(hidden, [c.block_m, c.block_k]),
        launch.descriptor(weight[: p.valid_columns], [c.block_n, c.block_k]),
        label_col, inv_temp, parts[0], parts[1], parts[2], parts[3],
        None if store is None else launch.descriptor(store.shifted, [c.block_m, c.block_n]),
        None if store is None else store.tile_max,
        n, hidden.shape[1], p.valid_columns, col_tiles, per, splits,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
        ENTROPY=p.calculate_entropy, STORE=store is not None, num_warps=c.num_warps, num_stages=c.num_stages,
    )
    if splits == 1:
        return parts[0, 0], parts[1, 0], parts[2, 0], parts[3, 0]
    return merge_partials(*parts.unbind(0))


def _zeros_for_none(grad: Tensor | None, like: Tensor) -> Tensor:
    return grad if grad is not None else torch.zeros(like.shape, dtype=torch.float32, device=like.device)


class RecomputingPasses:
    """Two-pass primitives: every scored row in one block (compacted when some are masked); statistics run the
    forward kernel, gradients recompute the logits chunk by chunk, except the first rows' when `kept` holds them.
    The backward's passes walk `groups` of those rows as blocks of their own (triton_recompute.row_groups).
    Saved for backward: the block (rows, int32 label column, 1/T), the weight, the kept logits."""

    def __init__(self, p: LogProbProblem | None, valid_columns: int, weight: Tensor, block: RowBlock,
                 kept: StoredLogits | None = None, groups: list[slice] | None = None):
        self.p, self.valid_columns, self.weight, self.block, self.kept = p, valid_columns, weight, block, kept
        self.groups = groups

    @property
    def block_count(self) -> int:
        return 1 if self.groups is None else len(self.groups)

    def blocks(self):
        if self.groups is None:
            yield self.block
            return
        b = self.block
        for group in self.groups:
            yield RowBlock(group, b.rows[group], b.hidden[group], b.label_col[group], b.inv_temp[group])

    def statistics(self, block: RowBlock):
        if self.kept is None:
            return local_statistics(self.p, block.hidden, self.weight, block.label_col, block.inv_temp)
        k = self.kept.shifted.shape[0]
        head = local_statistics(self.p, block.hidden[:k], self.weight, block.label_col[:k], block.inv_temp[:k], self.kept)
        if k == block.hidden.shape[0]:
            return head
        tail = local_statistics(self.p, block.hidden[k:], self.weight, block.label_col[k:], block.inv_temp[k:])
        return tuple(torch.cat(pair) for pair in zip(head, tail))

    def gradients(self, block: RowBlock, row_max, log_sum, shifted_mean, g_lp, g_ent, want_hidden: bool,
                  weight_sum: WeightGradientSum | None) -> Tensor | None:
        g_lp, g_ent = _zeros_for_none(g_lp, row_max), _zeros_for_none(g_ent, row_max)
        if self.kept is not None and self.kept.shifted.shape[0] == block.hidden.shape[0]:
            from .triton_chunk_kernels import kept_gradients

            return kept_gradients(self.kept, block, self.weight[: self.valid_columns], row_max, log_sum, shifted_mean,
                                  g_lp, g_ent, want_hidden, weight_sum)
        return recomputed_gradients(block, self.weight, self.valid_columns, row_max, log_sum, shifted_mean, g_lp, g_ent,
                                    want_hidden, weight_sum, self.kept)

    def for_backward(self):
        """The saved tensors, and the backward's passes: the kept rows' block, or the groups of rows that
        need the least memory for the gradients these inputs want."""
        b = self.block
        kept = () if self.kept is None else (self.kept.shifted, self.kept.tile_max)
        groups = None
        if self.kept is None:
            groups = row_groups(b.rows.numel(), b.hidden.shape[1], self.valid_columns, self.p.hidden.requires_grad,
                                self.p.weight.requires_grad, self.p.main_grad_dtype == torch.float32)
        return (b.hidden, self.weight, b.rows, b.label_col, b.inv_temp, *kept), functools.partial(
            _rebuilt_recomputing, self.valid_columns, groups
        )


def _rebuilt_recomputing(valid_columns: int, groups: list[slice] | None, hidden, weight, rows, label_col, inv_temp,
                         *kept) -> RecomputingPasses:
    stored = StoredLogits(*kept, FORWARD_CONFIG.block_n) if kept else None
    block = RowBlock(slice(0, rows.numel()), rows, hidden, label_col, inv_temp)
    return RecomputingPasses(None, valid_columns, weight, block, stored, None if groups is None or len(groups) == 1 else groups)


def two_pass_passes(p: LogProbProblem, for_backward: bool = False) -> RecomputingPasses:
    """for_backward with p.keep_logits_bytes: the forward kernel keeps the logits of as many scored rows as fit
    (whole row blocks, unless every row fits) for the backward."""
    block = _block(p, p.active_rows, slice(0, p.active_rows.numel()))
    kept = None
    if for_backward and p.keep_logits_bytes:
        kept = kept_rows_buffer(p.keep_logits_bytes, block.rows.numel(), p.valid_columns, FORWARD_CONFIG.block_m,
                                FORWARD_CONFIG.block_n, p.weight.device)
    return RecomputingPasses(p, p.valid_columns, launch.tma_ready(p.weight), block, kept)


class StoredLogitsPasses:
    """Loss-inside primitives over the chunks `spans`. With `keep`, the forward kernel reduces each chunk's logits
    to statistics and keeps them in fp16 (`StoredLogits`); the gradient pass overwrites them with d_logits in
    place (`triton_chunk_kernels`). 2 bytes per logit, one buffer of the largest chunk reused by every chunk.
    Without `keep` (no gradients) nothing is kept, and the spans are one: every scored row at once."""

    # The final loss evaluation runs on a high-priority stream beside the last chunk's GEMMs (host_evaluation.py).
    overlap_final_evaluation = True

    def __init__(self, p: LogProbProblem, keep: bool, spans: list[slice]):
        self.p, self.weight, self.spans = p, launch.tma_ready(p.weight), spans
        self.columns = p.valid_columns
        pitch, tiles = stored_layout(self.columns, FORWARD_CONFIG.block_n)
        self.block_count = len(spans)
        self.store = self.buffer = self.tile_max = None
        if keep and spans:
            rows = max(span.stop - span.start for span in spans)
            self.buffer = torch.empty(rows, pitch, dtype=torch.float16, device=p.weight.device)
            self.tile_max = torch.empty(rows, tiles, dtype=torch.float32, device=p.weight.device)

    def blocks(self):
        active = self.p.active_rows
        for span in self.spans:
            yield _block(self.p, active[span], span)

    def statistics(self, block: RowBlock):
        count = block.rows.numel()
        if self.buffer is not None:
            self.store = StoredLogits(self.buffer[:count, : self.columns], self.tile_max[:count], FORWARD_CONFIG.block_n)
        return local_statistics(self.p, block.hidden, self.weight, block.label_col, block.inv_temp, self.store)

    def gradients(self, block: RowBlock, row_max, log_sum, shifted_mean, g_lp, g_ent, want_hidden: bool,
                  weight_sum: WeightGradientSum | None) -> Tensor | None:
        from .triton_chunk_kernels import stored_grad_logits

        grad_logits = stored_grad_logits(
            self.store, block.label_col, block.inv_temp, row_max, log_sum, shifted_mean, g_lp,
            _zeros_for_none(g_ent, row_max), self.p.hidden.dtype,
        )
        if weight_sum is not None:
            weight_sum.add(grad_logits, block.hidden)
        return torch.mm(grad_logits, self.weight[: self.columns]) if want_hidden else None


def loss_inside_cost(p: LogProbProblem, keep: bool) -> ChunkCost | None:
    """Per scored row: the stored logits (2 bytes each, 4 per column tile for its max; what the budget limits),
    and beside them the row's compacted hidden copy and d_hidden product (input dtype), its partial statistics
    (at most one split per column tile) and per-row vectors. Fixed: a copy of a weight TMA cannot read.
    The smallest chunk is one row block of the forward kernel. Without `keep` nothing is kept: None, one block."""
    if not keep:
        return None
    pitch, tiles = stored_layout(p.valid_columns, FORWARD_CONFIG.block_n)
    h, width = p.hidden.shape[1], p.hidden.element_size()
    weight_copy = 0 if p.weight.is_contiguous() and p.weight.data_ptr() % 16 == 0 else p.weight.numel() * width
    block = FORWARD_CONFIG.block_m
    return ChunkCost(max(1, 2 * pitch + 4 * tiles), 2 * h * width + 16 * tiles + 64, weight_copy, block, block,
                     STORED_CHUNK_BUDGET_BYTES)


def loss_inside_passes(p: LogProbProblem, keep: bool, spans: list[slice]) -> StoredLogitsPasses:
    """The chunks `spans` (chunking.plan_chunks), each chunk's logits kept in fp16 when `keep`."""
    return StoredLogitsPasses(p, keep, spans)
