"""`token_log_probs`' Triton passes (host side; kernels in triton_kernels.py, shared launches in triton_backend.py).

Forward: the statistics kernel of `log_probs_and_entropy`, with its SQUARES flag when sum pi^2 is asked (one more
running sum, no more GEMM). Without top_k the asked ids' logits come from `token_logits_kernel`, a gather-dot in fp32 in
a fixed order over H. With top_k the rows go through the statistics kernel in chunks whose raw logits it also keeps in
fp32 (its STORE and RAW flags: the accumulator's own values, a bounded buffer, `KeptLogits`); the shard's top_k are
ranked on those exact values within each row's best tiles (`top_columns`), and the asked ids' logits are read from
them too: no second read of W's rows. Beyond the two-pass op's own per-row memory (its d_hidden sum), nothing grows
with N but the [N, k] inputs and outputs.

Backward: `triton_backend.recomputed_gradients` (the two-pass op's walk over vocabulary chunks and row tiles, row
groups as there), with the label's spike left out of the gradient kernel (label column -1, dense coefficient
g_lp + sum_j c_j) and `add_sparse_gradient_kernel` adding the label's and the ids' coefficients to each d_logits
tile before its two GEMMs: the same three GEMMs as the two-pass op. The tile's d_logits are already rounded to bf16
there, so the k + 1 sparse entries per row are rounded twice (each rounding 2^-9 relative).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import Tensor

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
    descriptor,
    forward_partials,
    recomputed_gradients,
    stored_layout,
    tma_ready,
)

# Memory of one chunk of rows under top_k unless the call says (`top_k_chunk_bytes`): the kept fp32 logits and tile
# maxima, and what the top-k's selection reads and writes (`_selection_bytes`).
TOP_K_CHUNK_BYTES = 1024**3
# Columns per group of a tile that the top-k's selection ranks by its largest logit between ranking tiles and ranking
# columns (16 of a 256-wide tile: 16 groups a tile, 16 columns a group).
GROUP_COLUMNS = 16
# The gather-dot's entries per program and hidden units per step (a fixed order over H: part of the op's results).
TOKEN_BLOCK = 16
HIDDEN_BLOCK = 128


@dataclass(frozen=True)
class KeptLogits:
    """A chunk's raw logits h . W_j as the forward kernel computed them, fp32 [rows, valid_columns] (row stride a
    multiple of 8 elements), and each row's max over every `group_columns`-wide group of every `tile_columns`-wide
    tile, fp32 [rows, column tiles x groups a tile] (the kernel's GROUP_N; -inf-like for groups of padding only)."""

    raw: Tensor
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
            torch.empty(rows, tiles * (width // group), dtype=torch.float32, device=device),
            width,
            group,
        )


def _top_k_chunk_rows(columns: int, top_k: int, distinct: bool, chunk_bytes: int) -> int | None:
    """Rows per forward chunk (whole row blocks of the statistics kernel, at least one) within `chunk_bytes` under
    top_k, None without top_k."""
    if not top_k:
        return None
    width = backend.FORWARD_CONFIG.block_n
    pitch, tiles = stored_layout(columns, width)
    per_row = 4 * pitch + 4 * tiles * (width // _group_columns(width))
    per_row += _selection_bytes(columns, width, min(top_k, columns), distinct)
    block_m = backend.FORWARD_CONFIG.block_m
    return max(block_m, chunk_bytes // per_row // block_m * block_m)


def _ranks_best_tiles(columns: int, width: int, wanted: int) -> bool:
    """Whether `top_columns` ranks only the best tiles: more whole tiles than wanted columns, and those tiles at
    most half the columns (otherwise every column is ranked)."""
    return columns // width > wanted and 8 * wanted * width <= 4 * columns


def _selection_bytes(columns: int, width: int, wanted: int, distinct: bool) -> int:
    """Bytes per row `top_columns` allocates: every column's value, or the tiles' maxima, the best tiles' group
    maxima, the best groups' columns and values and the partial tile; the int64 indices; with `distinct` the largest
    rank's int64 keys, their temporary and columns."""
    if not _ranks_best_tiles(columns, width, wanted):
        return 8 * wanted + (24 * columns if distinct else 0)
    group = _group_columns(width)
    keys = 24 * (wanted * group + width) if distinct else 0
    tiles = -(-columns // width)
    return 4 * tiles + 4 * wanted * (width // group) + 12 * wanted * group + 4 * width + 32 * wanted + keys


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
    rows' raw logits and group maxima written there (STORE and RAW)."""
    c = backend.FORWARD_CONFIG
    stored = None
    if kept is not None:
        stored = (
            descriptor(kept.raw, [c.block_m, c.block_n // 2]),
            descriptor(kept.group_max, [c.block_m, c.block_n // kept.group_columns]),
        )
    merged = forward_partials(
        p,
        hidden,
        weight,
        label_col,
        inv_temp,
        squares=squares,
        stored=stored,
        raw=kept is not None,
        group_columns=GROUP_COLUMNS if kept is None else kept.group_columns,
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


def top_columns(kept: KeptLogits, wanted: int, distinct: bool) -> Tensor:
    """The shard columns of each row's `wanted` largest kept logits, int64 [rows, wanted], in no particular order;
    equal logits by lower column first with `distinct` (`top_positions`: the set then depends on the row alone).

    Why not one topk over every column: each tile's max is one of its logits, so the `wanted` largest all lie in the
    `wanted` tiles of largest max (or in a partial last tile, always read); by the same argument within those tiles,
    in their `wanted` groups of GROUP_COLUMNS columns of largest max. With `distinct` a tile or group ranks by its
    max, then by its first column, which keeps that argument for equal values. At k=128 of 151936 columns the ranks
    run over 594 tile maxima, 2048 group maxima and 2048 logits instead of 151936; the forward kernel wrote every
    group's max, so only those 2048 group maxima and 2048 logits a row are read here. Where the best tiles would not be
    a fraction of the columns (few tiles, large k), every column is ranked. The logits are T-free; their order is
    z's (T > 0)."""
    raw, width, group = kept.raw, kept.tile_columns, kept.group_columns
    rows, columns = raw.shape
    whole = columns // width
    device = raw.device
    if not _ranks_best_tiles(columns, width, wanted):
        return top_positions(raw, torch.arange(columns, device=device), wanted, distinct)
    per_tile = width // group
    group_max = kept.group_max.view(rows, -1, per_tile)  # [rows, tiles, groups a tile]
    tiles = top_positions(group_max[:, :whole].amax(2), torch.arange(whole, device=device), wanted, distinct)
    best_tiles_groups = group_max.gather(1, tiles[:, :, None].expand(rows, wanted, per_tile)).view(rows, -1)
    group_first = None  # each group's first column, the tie-break of `distinct`
    if distinct:
        group_first = (tiles[:, :, None] * width + torch.arange(0, width, group, device=device)).view(rows, -1)
    groups = top_positions(best_tiles_groups, group_first, wanted, distinct)
    first_column = tiles.gather(1, groups // per_tile) * width + groups % per_tile * group  # [rows, wanted]
    group_columns = (first_column[:, :, None] + torch.arange(group, device=device)).view(rows, -1)
    values = raw.gather(1, group_columns)
    key_columns = group_columns if distinct else None
    if columns > whole * width:  # the partial last tile, whole
        values = torch.cat([values, raw[:, whole * width :]], 1)
        if distinct:
            tail_columns = torch.arange(whole * width, columns, device=device).expand(rows, -1)
            key_columns = torch.cat([key_columns, tail_columns], 1)
    best = top_positions(values, key_columns, wanted, distinct)
    in_groups = best < wanted * group
    from_group = group_columns.gather(1, best.clamp_max(wanted * group - 1))
    return torch.where(in_groups, from_group, best - wanted * group + whole * width)


def top_candidates(
    kept: KeptLogits, inv_temp: Tensor, top_k: int, vocab_start: int, distinct: bool
) -> tuple[Tensor, Tensor]:
    """The shard's top_k (fp32 logits, global ids, highest first; -inf / -1 padding) of the rows whose logits `kept`
    holds; `distinct` as in `top_columns`."""
    wanted = min(top_k, kept.raw.shape[1])
    columns = top_columns(kept, wanted, distinct)
    values, ids = select_top(kept_token_logits(kept, columns, inv_temp), columns + vocab_start, wanted)
    return pad_candidates(values, ids, top_k)


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
            kept = replace(self.kept, raw=self.kept.raw[:count], group_max=self.kept.group_max[:count])
        partials, squares = statistics_with_squares(
            p, block.hidden, self.weight, block.label_col, block.inv_temp, request.sum_squares, kept
        )
        logits = top_values = top_ids = None
        if request.token_columns is not None:
            columns = request.token_columns[block.span]
            if kept is not None:
                logits = kept_token_logits(kept, columns, block.inv_temp)
            else:
                logits = token_logits(block.hidden, self.weight, columns, block.inv_temp)
        if kept is not None:
            top_values, top_ids = top_candidates(kept, block.inv_temp, request.top_k, p.vocab_start, p.batch_invariant)
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
        columns, coefficients = sparse.columns.contiguous(), sparse.coefficients.contiguous()

        def add_sparse(dz: Tensor, rows: slice, chunk_start: int) -> None:
            from . import triton_kernels as kernels

            entries = columns.shape[1]
            if not entries or dz.shape[0] == 0:
                return
            kernels.add_sparse_gradient_kernel[(dz.shape[0],)](
                dz,
                dz.stride(0),
                columns[rows],
                coefficients[rows],
                block.inv_temp[rows],
                entries,
                chunk_start,
                dz.shape[1],
                BLOCK=max(16, 1 << (entries - 1).bit_length()),
            )

        return recomputed_gradients(
            no_label, self.weight, self.valid_columns, inputs, want_hidden, weight_sum, add_sparse=add_sparse
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
    chunk = _top_k_chunk_rows(p.valid_columns, request.top_k, p.batch_invariant, budget) or max(active, 1)
    spans = [slice(start, min(start + chunk, active)) for start in range(0, active, chunk)]
    return TritonTokenPasses(p, p.valid_columns, tma_ready(p.weight), block, request, spans)
