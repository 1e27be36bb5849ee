"""`token_log_probs`' Triton passes (host side; kernels in triton_kernels.py, shared launches in triton_backend.py).

Forward: the statistics kernel of `log_probs_and_entropy`, with its SQUARES flag when sum pi^2 is asked (one more
running sum, no more GEMM). Without top_k the asked ids' logits come from `token_logits_kernel`, a gather-dot in fp32 in
a fixed order over H. With top_k the rows go through the statistics kernel in chunks whose raw logits it also keeps in
fp32 (its STORE and RAW flags: the accumulator's own values, a bounded buffer, `KeptLogits`); the shard's top_k are
selected on those exact values by `top_k_kernel` (a program a row: its tile maxima, its best tiles' group maxima,
then its best groups' logits), and the asked ids' logits are read from them too: no second read of W's rows. Beyond
the two-pass op's own per-row memory (its d_hidden sum), nothing grows with N but the [N, k] inputs and outputs.

Backward: `triton_backend.recomputed_gradients` (the two-pass op's walk over vocabulary chunks and row tiles, row
groups as there), with the label's spike left out of the gradient kernel (label column -1, dense coefficient
g_lp + sum_j c_j) and the label's and the ids' coefficients added to each d_logits tile before its two GEMMs: the
same three GEMMs as the two-pass op. The coefficients are sorted by column and their repeats combined once
(`sort_sparse_gradient_kernel`), so each chunk's `add_sparse_gradient_kernel` reads only its own entries. The
tile's d_logits are already rounded to bf16 there, so the k + 1 sparse entries per row are rounded twice (each
rounding 2^-9 relative).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ...log_once import log_once
from ..arguments import LogProbProblem
from ..backward_plan import row_groups
from ..softmax_math import LogitGradientInputs, Partials
from ..token_math import (
    SparseLogitGradient,
    TokenPartials,
    TokenRequest,
    pad_candidates,
    select_top,
    top_positions,
)
from ..weight_gradient import WeightGradientSum
from . import RowBlock, SavedPasses
from . import triton_backend as backend  # its tile configurations read at call time
from .triton_backend import (
    forward_partials,
    recomputed_gradients,
    stored_layout,
    tma_ready,
)

logger = logging.getLogger(__name__)

# Memory of one chunk of rows under top_k unless the call says (`top_k_chunk_bytes`): the kept fp32 logits and tile
# maxima, and what the top-k's selection reads and writes (`_selection_bytes`).
TOP_K_CHUNK_BYTES = 1024**3
# Columns per group whose max the forward kernel writes beside the kept logits, for `top_k_kernel` to rank groups
# before columns (16 of a 256-wide tile: 16 groups a tile, 16 columns a group).
GROUP_COLUMNS = 16
# `top_k_kernel`'s limits: a row's tile maxima (262144 columns of 256-wide tiles) and its picked tiles' group
# maxima and groups' logits (16 x top_k each) sit in registers (`top_k_warps`; the sm_90 compile test: no spills up
# to k = 512, 120 bytes a thread at 1024).
MAX_SELECTION_TILES = 1024
MAX_SELECTION_TOP_K = 1024  # sampling replay's wider pass asks max_kept + 1 = 513 by default
# `top_k_kernel`'s values ranked at once a warp past one warp (`top_k_warps`).
SELECTION_VALUES_A_WARP = 512
# Asked columns `top_k_kernel` reads at once (a loop over more).
TOP_K_TOKENS_BLOCK = 128
# The sparse entries a chunk's add reads at once (about k / 18 of them fall in one chunk of a 151936 shard).
SPARSE_ADD_BLOCK = 32
# The gather-dot's entries per program and hidden units per step (a fixed order over H: part of the op's results).
TOKEN_BLOCK = 16
HIDDEN_BLOCK = 128


@dataclass(frozen=True)
class KeptLogits:
    """A chunk's raw logits h . W_j as the forward kernel computed them, fp32 [rows, valid_columns] (row stride a
    multiple of 8 elements), each row's max over every `tile_columns`-wide tile, fp32 [rows, column tiles], and over
    every `group_columns`-wide group of every tile, fp32 [rows, column tiles x groups a tile] (the kernel's GROUP_N;
    -inf-like for groups of padding only)."""

    raw: Tensor
    tile_max: Tensor
    group_max: Tensor
    tile_columns: int
    group_columns: int

    @classmethod
    def allocate(cls, rows: int, columns: int, width: int, device) -> KeptLogits:
        """Buffers for `rows` rows of `columns` logits in `width`-wide tiles, each row's start 16-byte aligned (TMA;
        the group maxima's rows are whole tiles of at least 4)."""
        pitch, tiles = stored_layout(columns, width)
        group = _group_columns(width)
        return cls(
            torch.empty(rows, pitch, dtype=torch.float32, device=device)[:, :columns],
            torch.empty(rows, tiles, dtype=torch.float32, device=device),
            torch.empty(rows, tiles * (width // group), dtype=torch.float32, device=device),
            width,
            group,
        )

    def first_rows(self, count: int) -> KeptLogits:
        """The buffers of the first `count` rows (a chunk shorter than the allocation)."""
        return replace(self, raw=self.raw[:count], tile_max=self.tile_max[:count], group_max=self.group_max[:count])


def _top_k_chunk_rows(columns: int, top_k: int, chunk_bytes: int) -> int | None:
    """Rows per forward chunk (whole row blocks of the statistics kernel, at least one) within `chunk_bytes` under
    top_k, None without top_k."""
    if not top_k:
        return None
    width = backend.FORWARD_CONFIG.block_n
    pitch, tiles = stored_layout(columns, width)
    per_row = 4 * pitch + 4 * tiles * (1 + width // _group_columns(width))
    per_row += _selection_bytes(columns, width, min(top_k, columns))
    block_m = backend.FORWARD_CONFIG.block_m
    return max(block_m, chunk_bytes // per_row // block_m * block_m)


def _selection_blocks(columns: int, width: int, wanted: int) -> tuple[int, int] | None:
    """`top_k_kernel`'s (BLOCK_T, BLOCK_K) for a shard of `columns` in `width`-wide tiles, None past its limits
    (then `top_candidates` ranks every column with torch.topk)."""
    blocks = 1 << (-(-columns // width) - 1).bit_length(), 1 << (wanted - 1).bit_length()
    return blocks if blocks[0] <= MAX_SELECTION_TILES and blocks[1] <= MAX_SELECTION_TOP_K else None


def top_k_warps(block_t: int, block_k: int, group: int, per_tile: int) -> int:
    """`top_k_kernel`'s warps: one (its searches then reduce within a warp, no block barrier) up to 32 values a
    thread, past that one per SELECTION_VALUES_A_WARP of the values it ranks at once (hiding the searches'
    latency). H100, 1536 rows of 151936 columns: k = 32 and 64 fastest on one warp, k = 128 on four (90 us against
    160 on one; before the search stopped early, 121 against 133 on two and 182 on one)."""
    largest = max(block_t, block_k * per_tile, block_k * group)
    return 1 if largest <= 32 * 32 else min(16, largest // SELECTION_VALUES_A_WARP)


def _selection_bytes(columns: int, width: int, wanted: int) -> int:
    """Bytes per row the top-k's selection allocates: the kernel's scratch and outputs, or torch.topk's int64 keys
    of every column and their temporary."""
    blocks = _selection_blocks(columns, width, wanted)
    if blocks is None:
        return 8 * wanted + 24 * columns
    return 4 * blocks[1] + 12 * wanted


def _group_columns(width: int) -> int:
    """GROUP_COLUMNS, or a quarter of a narrower tile (power-of-two widths): a row of the group maxima's TMA block
    needs at least 16 bytes, 4 fp32 maxima."""
    return min(GROUP_COLUMNS, width // 4)


def statistics_with_squares(
    p: LogProbProblem,
    hidden: Tensor,
    weight: Tensor,
    label_col: Tensor,
    inv_temp: Tensor,
    squares: bool,
    kept: KeptLogits | None,
) -> tuple[Partials, Tensor | None]:
    """This rank's partials of `hidden`'s rows and, with `squares`, their square sums relative to the row max: the
    forward kernel with its SQUARES flag, its tiles merged as triton_backend.local_statistics' are; with `kept`, the
    rows' raw logits, tile and group maxima written there (RAW; on Hopper the Gluon kernel writes the same bits)."""
    merged = forward_partials(
        p,
        hidden,
        weight,
        label_col,
        inv_temp,
        squares=squares,
        kept_raw=None if kept is None else (kept.raw, kept.tile_max, kept.group_max),
    )
    return Partials(*merged[:4]), merged[4] if squares else None


def token_logits(hidden: Tensor, weight: Tensor, columns: Tensor, inv_temp: Tensor) -> Tensor:
    """fp32 [R, entries]: h_i . W[columns_ij] / T_i, 0 where a column is -1 (`token_logits_kernel`)."""
    from . import triton_kernels as kernels

    rows, entries = columns.shape
    out = torch.empty(rows, entries, dtype=torch.float32, device=hidden.device)
    if rows and entries:
        kernels.token_logits_kernel[(rows, -(-entries // TOKEN_BLOCK))](
            hidden,
            hidden.stride(0),
            weight,
            weight.stride(0),
            columns.contiguous(),
            inv_temp.contiguous(),
            out,
            entries,
            hidden.shape[1],
            BLOCK_T=TOKEN_BLOCK,
            BLOCK_H=HIDDEN_BLOCK,
        )
    return out


def kept_token_logits(kept: KeptLogits, columns: Tensor, inv_temp: Tensor) -> Tensor:
    """fp32 [R, entries]: the kept raw logit of each column / T_i (scaled as the kernel scales the label's), 0 where
    a column is -1."""
    raw = kept.raw.gather(1, columns.clamp_min(0))
    return torch.where(columns >= 0, raw * inv_temp[:, None], 0.0)


def top_candidates(
    kept: KeptLogits, inv_temp: Tensor, top_k: int, vocab_start: int, columns: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The shard's top_k (fp32 logits z = raw / T, global ids, highest first; -inf / -1 padding) of the rows whose
    logits `kept` holds, equal logits by lower id first, so the set depends on the row alone, and the logits of
    `columns` (int64 [rows, entries], -1: none; as `kept_token_logits`, None when not given): `top_k_kernel`, one
    program a row reading its tile maxima, its best tiles' group maxima, its best groups' logits and the asked
    columns; past the kernel's limits (a shard over MAX_SELECTION_TILES tiles, top_k over MAX_SELECTION_TOP_K)
    torch.topk over every column, said in a log line."""
    from . import triton_kernels as kernels

    raw, rows, valid = kept.raw, kept.raw.shape[0], kept.raw.shape[1]
    wanted = min(top_k, valid)
    blocks = _selection_blocks(valid, kept.tile_columns, wanted)
    if blocks is None:
        log_once(
            logger,
            f"token_log_probs: top_k={top_k} of {valid} columns is past the top-k kernel's limits (top_k <= "
            f"{MAX_SELECTION_TOP_K}, {MAX_SELECTION_TILES} tiles of {kept.tile_columns} columns); its rows are "
            "ranked by torch.topk over every column",
        )
        positions = top_positions(raw, torch.arange(valid, device=raw.device), wanted, True)
        values, ids = select_top(kept_token_logits(kept, positions, inv_temp), positions + vocab_start, wanted)
        logits = None if columns is None else kept_token_logits(kept, columns, inv_temp)
        return (*pad_candidates(values, ids, top_k), logits)
    values = torch.empty(rows, wanted, dtype=torch.float32, device=raw.device)
    ids = torch.empty(rows, wanted, dtype=torch.int64, device=raw.device)
    logits = None
    if columns is not None:
        columns = columns.contiguous()
        logits = torch.empty(columns.shape, dtype=torch.float32, device=raw.device)
    if rows:
        block_t, block_k = blocks
        per_tile = kept.tile_columns // kept.group_columns
        tokens_block = 0
        if columns is not None:
            tokens_block = min(TOP_K_TOKENS_BLOCK, max(16, 1 << (columns.shape[1] - 1).bit_length()))
        kernels.top_k_kernel[(rows,)](
            raw,
            raw.stride(0),
            columns,
            logits,
            0 if columns is None else columns.shape[1],
            kept.tile_max,
            kept.tile_max.stride(0),
            kept.group_max,
            kept.group_max.stride(0),
            inv_temp.contiguous(),
            torch.empty(rows, block_k, dtype=torch.int32, device=raw.device),
            values,
            ids,
            wanted,
            kept.tile_max.shape[1],
            valid,
            wanted,
            vocab_start,
            GROUP=kept.group_columns,
            PER_TILE=per_tile,
            BLOCK_T=block_t,
            BLOCK_K=block_k,
            TOKENS_BLOCK=tokens_block,
            num_warps=top_k_warps(block_t, block_k, kept.group_columns, per_tile),
        )
    return (*pad_candidates(values, ids, top_k), logits)


def _sparse_adder(sparse: SparseLogitGradient, inv_temp: Tensor, valid_columns: int, chunk_columns: int):
    """`sparse` sorted by column and its repeats combined once (`sort_sparse_gradient_kernel`, with where each
    chunk of `chunk_columns` begins); the returned add(dz, rows, chunk_start) adds a chunk's entries to its d_logits
    tile, each launch reading only that chunk's entries (at k = 128 and 18 chunks, 1/18 of them)."""
    from . import triton_kernels as kernels

    rows, entries = sparse.columns.shape
    chunks = -(-valid_columns // chunk_columns)
    device = sparse.columns.device
    columns = torch.empty(rows, entries, dtype=torch.int32, device=device)
    coefficients = torch.empty(rows, entries, dtype=torch.float32, device=device)
    bounds = torch.empty(rows, chunks + 1, dtype=torch.int32, device=device)
    if rows and entries:
        kernels.sort_sparse_gradient_kernel[(rows,)](
            sparse.columns.contiguous(),
            sparse.coefficients.float().contiguous(),
            entries,
            columns,
            coefficients,
            bounds,
            chunk_columns,
            chunks,
            BLOCK=max(16, 1 << (entries - 1).bit_length()),
        )

    def add(dz: Tensor, tile: slice, chunk_start: int) -> None:
        if not entries or dz.shape[0] == 0:
            return
        kernels.add_sparse_gradient_kernel[(dz.shape[0],)](
            dz,
            dz.stride(0),
            columns[tile],
            coefficients[tile],
            bounds[tile],
            chunks + 1,
            inv_temp[tile],
            entries,
            chunk_start // chunk_columns,
            chunk_start,
            BLOCK=SPARSE_ADD_BLOCK,
            num_warps=1,
        )

    return add


class TritonTokenPasses:
    """The scored rows compacted into one block; the forward walks it in chunks under top_k (`spans`), the backward
    in the groups of `row_groups`."""

    def __init__(
        self,
        p: LogProbProblem | None,
        valid_columns: int,
        weight: Tensor,
        block: RowBlock,
        request: TokenRequest | None,
        spans: list[slice],
    ):
        self.p, self.valid_columns, self.weight, self.block, self.request = p, valid_columns, weight, block, request
        self.spans = spans
        self.block_count = len(spans)
        self.kept = None
        chunk = spans[0].stop - spans[0].start if spans else 0
        if request is not None and request.top_k and chunk and valid_columns:
            self.kept = KeptLogits.allocate(chunk, valid_columns, backend.FORWARD_CONFIG.block_n, weight.device)

    def blocks(self) -> Iterator[RowBlock]:
        b = self.block
        for span in self.spans:
            yield RowBlock(span, b.rows[span], b.hidden[span], b.label_col[span], b.inv_temp[span])

    def token_statistics(self, block: RowBlock) -> tuple[Partials, TokenPartials]:
        p, request, count = self.p, self.request, block.rows.numel()
        kept = None
        if self.kept is not None:
            kept = self.kept.first_rows(count)
        partials, squares = statistics_with_squares(
            p, block.hidden, self.weight, block.label_col, block.inv_temp, request.sum_squares, kept
        )
        logits = top_values = top_ids = None
        columns = None if request.token_columns is None else request.token_columns[block.span]
        if kept is not None:
            top_values, top_ids, logits = top_candidates(kept, block.inv_temp, request.top_k, p.vocab_start, columns)
        elif columns is not None:
            logits = token_logits(block.hidden, self.weight, columns, block.inv_temp)
        return partials, TokenPartials(logits, squares, top_values, top_ids)

    def token_gradients(
        self,
        block: RowBlock,
        inputs: LogitGradientInputs,
        sparse: SparseLogitGradient,
        want_hidden: bool,
        weight_sum: WeightGradientSum | None,
    ) -> Tensor | None:
        """The two-pass op's recomputing walk with the label's spike left to `sparse`, added per d_logits tile."""
        zeros = torch.zeros(block.rows.numel(), dtype=torch.float32, device=block.hidden.device)
        inputs = inputs._replace(
            g_lp=zeros if inputs.g_lp is None else inputs.g_lp, g_ent=zeros if inputs.g_ent is None else inputs.g_ent
        )
        no_label = replace(block, label_col=torch.full_like(block.label_col, -1))
        return recomputed_gradients(
            no_label,
            self.weight,
            self.valid_columns,
            inputs,
            want_hidden,
            weight_sum,
            sparse_adder=functools.partial(_sparse_adder, sparse, block.inv_temp, self.valid_columns),
        )

    def for_backward(self) -> SavedPasses:
        b, p = self.block, self.p
        grad = backend.GRAD_CONFIG
        groups = row_groups(
            b.rows.numel(),
            b.hidden.shape[1],
            self.valid_columns,
            p.hidden.requires_grad,
            p.weight.requires_grad,
            p.main_grad_dtype == torch.float32,
            block_m=grad.block_m,
            block_n=grad.block_n,
        )
        return SavedPasses(
            (b.hidden, self.weight, b.rows, b.label_col, b.inv_temp),
            functools.partial(_rebuilt, self.valid_columns, groups),
        )


def _rebuilt(valid_columns: int, groups: list[slice], hidden, weight, rows, label_col, inv_temp) -> TritonTokenPasses:
    block = RowBlock(slice(0, rows.numel()), rows, hidden, label_col, inv_temp)
    return TritonTokenPasses(None, valid_columns, weight, block, None, groups)


def selected_token_passes(p: LogProbProblem, request: TokenRequest) -> TritonTokenPasses:
    """Every scored row in one compacted block; the forward in chunks of bounded kept logits under top_k."""
    active = p.active_rows.numel()
    block = backend._block(p, p.active_rows, slice(0, active))
    budget = request.chunk_bytes or TOP_K_CHUNK_BYTES
    chunk = _top_k_chunk_rows(p.valid_columns, request.top_k, budget) or max(active, 1)
    spans = [slice(start, min(start + chunk, active)) for start in range(0, active, chunk)]
    return TritonTokenPasses(p, p.valid_columns, tma_ready(p.weight), block, request, spans)
