"""The Triton backend's host side (CUDA, Hopper first): availability, launches, and the passes both drivers walk.
Its kernels are triton_kernels.py's (on Hopper the forward's, but for fp16 kept logits, gluon_forward.py's).

Forward (both ops): one kernel reduces each scored row's logits to one Partial per column tile; logits never reach
memory. Another merges a row's tiles with softmax_math's formulas in an order fixed by the shard's width, so a row's
values are the same bits whatever batch computes it, whatever layout of programs ran (`forward_partials`).

Two-pass op (`RecomputingPasses`): the backward recomputes the logits one vocabulary chunk at a time
(`recomputed_gradients`): per chunk and tile of rows, `grad_logits_kernel` recomputes the logits and writes
d_logits (bf16); two cuBLAS GEMMs then add that tile's share of d_hidden into an fp32 accumulator and of the
chunk's d_weight rows. Tiles, groups and chunk widths come from fixed budgets, shapes and the GPU's SM count
(backward_plan.py): the same chunks at every N from ~12000 rows, fewer and wider ones below.

Kept logits: the forward kernel can also keep the logits as fp16 differences to each tile's row max
(`StoredLogits`), which `stored_grad_logits` overwrites in place with d_logits (two bytes read and two written a
logit, the recompute's arithmetic). The loss-inside op (`StoredLogitsPasses`) keeps every chunk's logits (chunks
from chunking.py's `loss_inside_cost`); the two-pass op those of as many scored rows as keep_logits_bytes holds,
which skip the recompute. A kept buffer the GPU cannot give must not stop a step: the call recomputes every row
and a warning says so once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ...log_once import log_once
from ..arguments import LogProbProblem
from ..backward_plan import backward_tiling, row_groups
from ..chunking import ChunkCost
from ..softmax_math import (
    LogitGradientInputs,
    Partials,
    inverse_temperature,
    label_columns,
    no_column_partials,
)
from ..weight_gradient import WeightGradientSum
from . import RowBlock, SavedPasses
from .forward_layout import tile_partial_rows, tiles_per_split
from .gluon_choice import gluon_forward_kernel

logger = logging.getLogger(__name__)

# The loss-inside op's chunk of stored logits (fp16, then d_logits in place). More rows per chunk add fewer times
# into the fp32 d_weight accumulator (V_local x H x 4 bytes; none with one chunk) and leave more GPU work queued
# behind loss_fn's final host evaluation (~21 ms for verl's ppo_loss at 65k tokens). H200, 65536 x 2048 x 151936:
# 4 GiB (5 chunks) 0.84x the 4-GEMM floor, 2 GiB (10 chunks) 0.885x.
STORED_CHUNK_BUDGET_BYTES = 4 * 1024**3

# merge_tiles_kernel's block: one warp, a row per thread (a row's tiles then sit in one thread: one order); a
# program merges MERGE_TILES tiles (a group), then one more launch the groups, MERGE_TILES at a time.
MERGE_ROWS = 32
MERGE_TILES = 16
# Columns per program of the in-place gradient pass over kept logits.
GRAD_BLOCK = 2048


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
# One persistent 8-warp program per SM (why, with its H200 figures: grad_logits_kernel's docstring).
GRAD_CONFIG = TileConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, ctas_per_sm=1)


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """Row-major with a 16-byte aligned base, as TMA descriptors require (copies only if not)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return out.copy_(t)


def descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


@functools.cache
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# asked on every call; reading the device's properties took ~30 us of host time the GPU waited for
_capability = functools.cache(torch.cuda.get_device_capability)


def unavailable_reason(p: LogProbProblem) -> str | None:
    """None when this backend can run `p`, else why not (auto logs it and falls back)."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if p.hidden.device.type != "cuda":
        return f"hidden is on {p.hidden.device.type}"
    if _capability(p.hidden.device)[0] < 9:
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


@dataclass(frozen=True)
class StoredLogits:
    """Where the forward kernel keeps logits for a gradient pass: `shifted`, fp16 [rows, valid_columns] (row stride
    a multiple of 8 elements), each `tile_columns`-wide tile (the forward kernel's block_n) relative to its own row
    max, and that max, fp32 [rows, column tiles]."""

    shifted: torch.Tensor
    tile_max: torch.Tensor
    tile_columns: int


def stored_layout(columns: int, tile_columns: int) -> tuple[int, int]:
    """(row pitch of the fp16 logits: TMA needs 16-byte aligned rows, column tiles of the forward kernel)."""
    return -(-columns // 8) * 8, -(-columns // tile_columns)


def kept_rows_buffer(
    budget: int, rows: int, columns: int, row_block: int, tile_columns: int, device: torch.device
) -> StoredLogits | None:
    """Room for the logits of the first K of `rows` scored rows, K as many as `budget` bytes hold (whole
    `row_block`s unless every row fits); None when none fit, or when the allocator refuses (logged)."""
    pitch, tiles = stored_layout(columns, tile_columns)
    fit = budget // (2 * pitch + 4 * tiles)
    kept = rows if fit >= rows else fit // row_block * row_block
    if kept == 0 or columns == 0:
        return None
    try:
        shifted = torch.empty(kept, pitch, dtype=torch.float16, device=device)[:, :columns]
        return StoredLogits(shifted, torch.empty(kept, tiles, dtype=torch.float32, device=device), tile_columns)
    except torch.OutOfMemoryError as error:
        reason = " ".join(str(error).split())[:240]
        log_once(
            logger,
            f"log_probs_and_entropy: keep_logits_bytes: {kept} rows of kept logits could not be allocated "
            f"({reason}); this call recomputes every row's logits in its backward",
            logging.WARNING,
            key="kept logits refused",
            later=logging.DEBUG,
        )
        return None


def split_layout(row_blocks: int, col_tiles: int, device, config: TileConfig | None = None) -> int:
    """Tiles per split of the forward kernel (`config`, None: FORWARD_CONFIG) for `row_blocks` blocks of rows: the
    fastest layout for the row count, which a row's values do not depend on (`forward_statistics_kernel`)."""
    slots = num_sms(device) * (FORWARD_CONFIG if config is None else config).ctas_per_sm
    return tiles_per_split(col_tiles, slots, row_blocks)


def _block(p: LogProbProblem, rows: Tensor, span: slice) -> RowBlock:
    """Scored rows compacted (unless they are every row) and TMA-ready, label column as int32."""
    hidden = tma_ready(p.hidden if rows.numel() == p.num_rows else p.hidden.index_select(0, rows))
    label_col = label_columns(p, rows).to(torch.int32)
    return RowBlock(span, rows, hidden, label_col, inverse_temperature(p.temperature, rows))


def local_statistics(
    p: LogProbProblem,
    hidden,
    weight,
    label_col,
    inv_temp,
    store: StoredLogits | None = None,
    *,
    config: TileConfig | None = None,
    per_split: int | None = None,
) -> Partials:
    """This rank's partials per row of `hidden` (the scored rows, compacted), from the forward kernel; with `store`,
    the kernel also writes the logits there. `config` (None: FORWARD_CONFIG, read at the call) and `per_split`
    (column tiles per split; None: `split_layout`'s) let scripts/sweep_forward_tiles.py time Triton's kernel with
    other tiles and layouts; the op passes neither."""
    if p.valid_columns == 0 or hidden.shape[0] == 0:
        return no_column_partials(hidden.shape[0], hidden.device)
    stored = None
    if store is not None:
        c = FORWARD_CONFIG if config is None else config
        stored = (descriptor(store.shifted, [c.block_m, c.block_n]), store.tile_max, None)
    merged = forward_partials(p, hidden, weight, label_col, inv_temp, stored=stored, config=config, per_split=per_split)
    return Partials(*merged.unbind(0))


def forward_partials(
    p: LogProbProblem,
    hidden: Tensor,
    weight: Tensor,
    label_col: Tensor,
    inv_temp: Tensor,
    *,
    squares: bool = False,
    stored: tuple | None = None,
    kept_raw: tuple[Tensor, Tensor, Tensor] | None = None,
    config: TileConfig | None = None,
    per_split: int | None = None,
) -> Tensor:
    """fp32 [4, rows] (with `squares` [5, rows]): the merged partials of `hidden`'s rows (p.valid_columns > 0), the
    forward kernel's per-tile partials merged by `merge_tiles`. `stored`: (store_desc, tile_max, None) for fp16
    kept logits; `kept_raw`: fp32 (logits, tile maxima, group maxima) written too; either one chunk of rows. Without,
    rows past TILE_PARTIALS_BUDGET_BYTES run as further launches. On Hopper all but fp16 stores run in Gluon."""
    from . import triton_kernels as kernels

    n = hidden.shape[0]
    gluon = gluon_forward_kernel(hidden.device) if stored is None and config is None and per_split is None else None
    c = FORWARD_CONFIG if config is None else config
    col_tiles = -(-p.valid_columns // c.block_n)
    planes = 5 if squares else 4
    group = n if stored or kept_raw else tile_partial_rows(col_tiles, planes, c.block_m)
    groups = 16 if kept_raw is None else kept_raw[2].shape[1] // col_tiles  # group maxima a tile
    if kept_raw is not None and not gluon:
        raw, tile_max, group_max = kept_raw
        stored = descriptor(raw, [c.block_m, c.block_n // 2]), tile_max, descriptor(group_max, [c.block_m, groups])
    valid_weight = weight[: p.valid_columns]
    w_desc = gluon.weight_descriptor(valid_weight) if gluon else descriptor(valid_weight, [c.block_n, c.block_k])
    merged = torch.empty(planes, n, dtype=torch.float32, device=hidden.device)
    buffer = torch.empty(planes * col_tiles * min(n, group), dtype=torch.float32, device=hidden.device)
    for start in range(0, n, group):
        rows = min(group, n - start)
        span = slice(start, start + rows)
        parts = buffer[: planes * col_tiles * rows].view(planes, col_tiles, rows)
        if gluon:
            gluon.tile_partials(hidden[span], w_desc, p.valid_columns, label_col[span], inv_temp[span], parts,
                                p.calculate_entropy, num_sms(hidden.device), kept_raw)  # fmt: skip
        else:
            row_blocks = -(-rows // c.block_m)
            per = split_layout(row_blocks, col_tiles, hidden.device, c) if per_split is None else per_split
            splits = -(-col_tiles // per)
            kernels.forward_statistics_kernel[(row_blocks * splits,)](
                descriptor(hidden[span], [c.block_m, c.block_k]), w_desc, label_col[span], inv_temp[span], parts,
                *(stored or (None, None, None)), rows, hidden.shape[1], p.valid_columns, col_tiles, per, splits,
                BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
                ENTROPY=p.calculate_entropy, STORE=stored is not None, num_warps=c.num_warps, num_stages=c.num_stages,
                SQUARES=squares, RAW=kept_raw is not None, GROUP_N=c.block_n // groups,
            )  # fmt: skip
        merge_tiles(parts, merged[:, span])
    return merged


def merge_tiles(parts: Tensor, out: Tensor) -> Tensor:
    """`out` (fp32 [planes, rows], rows contiguous) filled with one partial per row from the forward kernel's
    per-tile partials (fp32 [planes, tiles, rows], contiguous; planes 4, or 5 with the square sums): first each
    group of MERGE_TILES tiles in a program of its own (rows x groups programs: enough of them at 1024 rows), then
    the groups, in an order fixed by the tile count."""
    from . import triton_kernels as kernels

    planes, tiles, n = parts.shape
    options = dict(PLANES=planes, BLOCK_S=MERGE_TILES, BLOCK_R=MERGE_ROWS, num_warps=1)
    if tiles > MERGE_TILES:
        groups = -(-tiles // MERGE_TILES)
        grouped = torch.empty(planes, groups, n, dtype=torch.float32, device=parts.device)
        grid = (-(-n // MERGE_ROWS), groups)
        kernels.merge_tiles_kernel[grid](parts, grouped, n, tiles, MERGE_TILES, groups * n, n, **options)
        parts, tiles = grouped, groups
    kernels.merge_tiles_kernel[(-(-n // MERGE_ROWS), 1)](parts, out, n, tiles, tiles, out.stride(0), 0, **options)
    return out


def recomputed_gradients(
    block: RowBlock,
    weight: Tensor,
    valid_columns: int,
    inputs: LogitGradientInputs,
    want_hidden: bool,
    weight_sum: WeightGradientSum | None,
    kept: StoredLogits | None = None,
    sparse_adder=None,
) -> Tensor | None:
    """fp32 d_hidden of the block (or None); its share of d_weight[:valid_columns] chunk by chunk through
    weight_sum. The block's first rows, when `kept` holds their logits, are one more row tile whose d_logits
    come from there. `inputs`: no gradient None. `sparse_adder(chunk_columns)` (token_log_probs) returns
    `add(dz, rows, chunk_start)`, adding a sparse part to each recomputed d_logits tile before its GEMMs."""
    from . import triton_kernels as kernels

    hidden = block.hidden
    n, h = hidden.shape
    c = GRAD_CONFIG
    k = 0 if kept is None else kept.shifted.shape[0]
    slots = num_sms(hidden.device) * c.ctas_per_sm
    tiling = backward_tiling(n - k, h, valid_columns, c.block_m, c.block_n, slots)
    tiles = ([(0, k)] if k else []) + [(k + first, count) for first, count in tiling.tiles(n - k)]
    dz_buffer = torch.empty(tiling.rows, tiling.columns, dtype=hidden.dtype, device=hidden.device) if n > k else None
    d_hidden = torch.zeros(n, h, dtype=torch.float32, device=hidden.device) if want_hidden else None
    # The only block's row tiles add into a chunk's d_weight rows in fp32, rounded once (row groups: the sum's buffer)
    dw_chunk = None
    if (
        weight_sum is not None
        and weight_sum.products == 1
        and len(tiles) > 1
        and weight_sum.total.dtype != torch.float32
    ):
        dw_chunk = torch.empty(tiling.columns, h, dtype=torch.float32, device=hidden.device)
    w_desc = descriptor(weight[:valid_columns], [c.block_n, c.block_k])
    add_sparse = None if sparse_adder is None else sparse_adder(tiling.columns)
    row_args = (block.label_col, block.inv_temp, *inputs)
    for start in range(0, valid_columns, tiling.columns):
        cols = min(tiling.columns, valid_columns - start)
        w_chunk = weight[start : start + cols]
        chunk_sum = None
        if weight_sum is not None:
            chunk_sum = weight_sum.columns(
                start, start + cols, len(tiles), None if dw_chunk is None else dw_chunk[:cols]
            )
        for first, count in tiles:
            rows = slice(first, first + count)
            if first < k:  # the kept rows: d_logits over their stored logits, in place
                dz = stored_grad_logits(kept, *(t[rows] for t in row_args), hidden.dtype, columns=(start, start + cols))
            else:
                dz = dz_buffer[:count, :cols]
                programs = min(-(-count // c.block_m) * -(-cols // c.block_n), slots)
                kernels.grad_logits_kernel[(programs,)](
                    descriptor(hidden[rows], [c.block_m, c.block_k]), w_desc,
                    descriptor(dz, [c.block_m, c.block_n]),
                    *(t[rows] for t in row_args),
                    count, h, start, cols, programs,
                    BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m,
                    num_warps=c.num_warps, num_stages=c.num_stages,
                )  # fmt: skip
                if add_sparse is not None:
                    add_sparse(dz, rows, start)
            if d_hidden is not None:
                torch.addmm(d_hidden[rows], dz, w_chunk, out_dtype=torch.float32, out=d_hidden[rows])
            if chunk_sum is not None:
                chunk_sum.add(dz, hidden[rows])
        if chunk_sum is not None:
            chunk_sum.finish()
    return d_hidden


def stored_grad_logits(
    store,
    label_col,
    inv_temp,
    row_max,
    log_sum,
    shifted_mean,
    g_lp,
    g_ent,
    out_dtype: torch.dtype,
    columns: tuple[int, int] | None = None,
) -> torch.Tensor:
    """d_logits [R, C] in out_dtype (2 bytes) of sum_i g_lp_i log p_i + g_ent_i H_i with respect to the raw
    logits, written over `store.shifted` (a StoredLogits) and returned
    as a view of it (same strides); only its `columns` [start, stop) when given (start on a tile boundary).
    row_max, log_sum, shifted_mean are the global (tensor-parallel merged) statistics, label_col -1 where
    another rank holds the label. The arguments are the kernel's per-row vectors, in its order."""
    from . import triton_kernels as kernels

    shifted, tile_max = store.shifted, store.tile_max
    if columns is not None:
        start, stop = columns
        if start % store.tile_columns:
            raise ValueError(f"columns: must start on a {store.tile_columns}-column tile boundary, got {start}")
        shifted, tile_max, label_col = (
            shifted[:, start:stop],
            tile_max[:, start // store.tile_columns :],
            label_col - start,
        )
    if torch.empty((), dtype=out_dtype).element_size() != shifted.element_size():
        raise ValueError(f"out_dtype: must be a 2-byte float to overwrite the stored logits, got {out_dtype}")
    rows, width = shifted.shape
    dz = shifted.view(out_dtype)
    if rows and width:
        vectors = [t.float().contiguous() for t in (inv_temp, row_max, log_sum, shifted_mean, g_lp, g_ent)]
        kernels.stored_grad_logits_kernel[(rows, -(-width // GRAD_BLOCK))](
            shifted, dz, shifted.stride(0), tile_max, tile_max.stride(0),
            label_col.to(torch.int64).contiguous(), *vectors,
            width, TILE_N=store.tile_columns, BLOCK=GRAD_BLOCK, num_warps=8,
        )  # fmt: skip
    return dz


def kept_gradients(
    store: StoredLogits,
    block: RowBlock,
    weight: Tensor,
    inputs: LogitGradientInputs,
    want_hidden: bool,
    weight_sum: WeightGradientSum | None,
) -> Tensor | None:
    """The two-pass op's backward when every scored row's logits were kept (keep_logits_bytes): d_logits over all
    of them in place, then one GEMM for the block's d_weight (into weight_sum) and one for its d_hidden (the sum
    over the vocabulary in cuBLAS's fp32, rounded once: no accumulator, no chunks). `inputs`: no gradient None."""
    dz = stored_grad_logits(store, block.label_col, block.inv_temp, *inputs, block.hidden.dtype)
    if weight_sum is not None:
        weight_sum.add(dz, block.hidden)
    return torch.mm(dz, weight) if want_hidden else None


def _zeros_for_none(grad: Tensor | None, like: Tensor) -> Tensor:
    return grad if grad is not None else torch.zeros(like.shape, dtype=torch.float32, device=like.device)


class RecomputingPasses:
    """Two-pass passes: every scored row in one block (compacted when some are masked); statistics run the
    forward kernel, gradients recompute the logits chunk by chunk, except the first rows' when `kept` holds them.
    The backward's passes walk `groups` of those rows as blocks of their own (`row_groups`).
    Saved for backward: the block (rows, int32 label column, 1/T), the weight, the kept logits."""

    def __init__(
        self,
        p: LogProbProblem | None,
        valid_columns: int,
        weight: Tensor,
        block: RowBlock,
        kept: StoredLogits | None = None,
        groups: list[slice] | None = None,
    ):
        self.p, self.valid_columns, self.weight, self.block, self.kept = p, valid_columns, weight, block, kept
        self.groups = groups

    @property
    def block_count(self) -> int:
        return 1 if self.groups is None else len(self.groups)

    def blocks(self) -> Iterator[RowBlock]:
        if self.groups is None:
            yield self.block
            return
        b = self.block
        for group in self.groups:
            yield RowBlock(group, b.rows[group], b.hidden[group], b.label_col[group], b.inv_temp[group])

    def statistics(self, block: RowBlock) -> Partials:
        if self.kept is None:
            return local_statistics(self.p, block.hidden, self.weight, block.label_col, block.inv_temp)
        k = self.kept.shifted.shape[0]
        head = local_statistics(
            self.p, block.hidden[:k], self.weight, block.label_col[:k], block.inv_temp[:k], self.kept
        )
        if k == block.hidden.shape[0]:
            return head
        tail = local_statistics(self.p, block.hidden[k:], self.weight, block.label_col[k:], block.inv_temp[k:])
        return Partials(*(torch.cat(pair) for pair in zip(head, tail)))

    def gradients(
        self, block: RowBlock, inputs: LogitGradientInputs, want_hidden: bool, weight_sum: WeightGradientSum | None
    ) -> Tensor | None:
        inputs = inputs._replace(
            g_lp=_zeros_for_none(inputs.g_lp, inputs.row_max), g_ent=_zeros_for_none(inputs.g_ent, inputs.row_max)
        )
        if self.kept is not None and self.kept.shifted.shape[0] == block.hidden.shape[0]:
            return kept_gradients(self.kept, block, self.weight[: self.valid_columns], inputs, want_hidden, weight_sum)
        return recomputed_gradients(block, self.weight, self.valid_columns, inputs, want_hidden, weight_sum, self.kept)

    def for_backward(self) -> SavedPasses:
        """The saved tensors, and the backward's passes: the kept rows' block, or the groups of rows that
        need the least memory for the gradients these inputs want."""
        b = self.block
        kept = () if self.kept is None else (self.kept.shifted, self.kept.tile_max)
        groups = None
        if self.kept is None:
            groups = row_groups(
                b.rows.numel(),
                b.hidden.shape[1],
                self.valid_columns,
                self.p.hidden.requires_grad,
                self.p.weight.requires_grad,
                self.p.main_grad_dtype == torch.float32,
                block_m=GRAD_CONFIG.block_m,
                block_n=GRAD_CONFIG.block_n,
            )
        return SavedPasses(
            (b.hidden, self.weight, b.rows, b.label_col, b.inv_temp, *kept),
            functools.partial(_rebuilt_recomputing, self.valid_columns, groups),
        )


def _rebuilt_recomputing(
    valid_columns: int, groups: list[slice] | None, hidden, weight, rows, label_col, inv_temp, *kept
) -> RecomputingPasses:
    stored = StoredLogits(*kept, FORWARD_CONFIG.block_n) if kept else None
    block = RowBlock(slice(0, rows.numel()), rows, hidden, label_col, inv_temp)
    return RecomputingPasses(
        None, valid_columns, weight, block, stored, None if groups is None or len(groups) == 1 else groups
    )


def two_pass_passes(p: LogProbProblem, for_backward: bool = False) -> RecomputingPasses:
    """for_backward with p.keep_logits_bytes: the forward kernel keeps the logits of as many scored rows as fit
    (whole row blocks, unless every row fits) for the backward."""
    block = _block(p, p.active_rows, slice(0, p.active_rows.numel()))
    kept = None
    if for_backward and p.keep_logits_bytes:
        kept = kept_rows_buffer(
            p.keep_logits_bytes,
            block.rows.numel(),
            p.valid_columns,
            FORWARD_CONFIG.block_m,
            FORWARD_CONFIG.block_n,
            p.weight.device,
        )
    return RecomputingPasses(p, p.valid_columns, tma_ready(p.weight), block, kept)


class StoredLogitsPasses:
    """Loss-inside passes over the chunks `spans`. With `keep`, the forward kernel reduces each chunk's logits
    to statistics and keeps them in fp16 (`StoredLogits`); the gradient pass overwrites them with d_logits in
    place (`stored_grad_logits`). 2 bytes per logit, one buffer of the largest chunk reused by every chunk.
    Without `keep` (no gradients) nothing is kept, and the spans are one: every scored row at once."""

    # The final loss evaluation runs on a high-priority stream beside the last chunk's GEMMs (loss_inside.py).
    overlap_final_evaluation = True

    def __init__(self, p: LogProbProblem, keep: bool, spans: list[slice]):
        self.p, self.weight, self.spans = p, tma_ready(p.weight), spans
        self.columns = p.valid_columns
        pitch, tiles = stored_layout(self.columns, FORWARD_CONFIG.block_n)
        self.block_count = len(spans)
        self.store = self.buffer = self.tile_max = None
        if keep and spans:
            rows = max(span.stop - span.start for span in spans)
            self.buffer = torch.empty(rows, pitch, dtype=torch.float16, device=p.weight.device)
            self.tile_max = torch.empty(rows, tiles, dtype=torch.float32, device=p.weight.device)

    def blocks(self) -> Iterator[RowBlock]:
        active = self.p.active_rows
        for span in self.spans:
            yield _block(self.p, active[span], span)

    def statistics(self, block: RowBlock) -> Partials:
        count = block.rows.numel()
        if self.buffer is not None:
            self.store = StoredLogits(
                self.buffer[:count, : self.columns], self.tile_max[:count], FORWARD_CONFIG.block_n
            )
        return local_statistics(self.p, block.hidden, self.weight, block.label_col, block.inv_temp, self.store)

    def gradients(
        self, block: RowBlock, inputs: LogitGradientInputs, want_hidden: bool, weight_sum: WeightGradientSum | None
    ) -> Tensor | None:
        """`inputs.g_lp` a tensor (the loss's), `inputs.g_ent` None without the entropy."""
        inputs = inputs._replace(g_ent=_zeros_for_none(inputs.g_ent, inputs.row_max))
        grad_logits = stored_grad_logits(self.store, block.label_col, block.inv_temp, *inputs, self.p.hidden.dtype)
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
    return ChunkCost(
        max(1, 2 * pitch + 4 * tiles),
        2 * h * width + 16 * tiles + 64,
        weight_copy,
        block,
        block,
        STORED_CHUNK_BUDGET_BYTES,
    )


def loss_inside_passes(p: LogProbProblem, keep: bool, spans: list[slice]) -> StoredLogitsPasses:
    """The chunks `spans` (chunking.plan_chunks), each chunk's logits kept in fp16 when `keep`."""
    return StoredLogitsPasses(p, keep, spans)
