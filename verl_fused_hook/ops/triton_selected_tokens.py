"""`token_log_probs`' Triton passes (host side; kernels in triton_kernels.py, shared launches in triton_backend.py).

Forward: the statistics kernel of `log_probs_and_entropy`, with its SQUARES flag when sum pi^2 is asked (one more
running sum, no more GEMM); the asked ids' logits by `token_logits_kernel`, a gather-dot in fp32 in a fixed order over
H. With top_k the rows go through the statistics kernel in chunks whose logits it also keeps (its STORE path, fp16
relative to each tile's row max, a bounded buffer); the top_k + TOP_K_SLACK largest of those approximations are the
candidates, their exact logits come from the gather-dot, and the top_k of those are the shard's. Nothing grows with
N but the [N, k] inputs and outputs.

Backward: `triton_backend.recomputed_gradients` (the two-pass op's walk over vocabulary chunks and row tiles, row
groups as there), with the label's spike left out of the gradient kernel (label column -1, dense coefficient
g_lp + sum_j c_j) and `add_sparse_gradient_kernel` adding the label's and the ids' coefficients to each d_logits
tile before its two GEMMs: the same three GEMMs as the two-pass op. The tile's d_logits are already rounded to bf16
there, so the k + 1 sparse entries per row are rounded twice (each rounding 2^-9 relative).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import Tensor

from . import triton_backend as backend  # its tile configurations read at call time
from .arguments import LogProbProblem
from .backends import RowBlock, SavedPasses
from .backward_plan import row_groups
from .softmax_math import LogitGradientInputs, Partials, merge_partials
from .token_math import (
    SparseLogitGradient,
    TokenPartials,
    TokenRequest,
    merge_square_sums,
    pad_candidates,
    select_top,
    top_positions,
)
from .triton_backend import (
    StoredLogits,
    descriptor,
    recomputed_gradients,
    split_layout,
    stored_layout,
    tma_ready,
)
from .weight_gradient import WeightGradientSum

# Candidates beyond top_k taken from the fp16 approximations before the exact logits decide: an id of the true top_k
# is missed only if more than TOP_K_SLACK others overtake it by fp16 rounding (2^-11 of its distance to its tile's
# max, in raw units).
TOP_K_SLACK = 16
# Memory of one chunk of rows under top_k: the kept fp16 logits and tile maxima, and what the candidates' selection
# reads and writes (`_selection_bytes`).
TOP_K_CHUNK_BYTES = 1024**3
# Columns per group of a tile that the candidates' selection ranks by its largest approximation between ranking
# tiles and ranking columns (16 of a 256-wide tile: 16 groups a tile, 16 columns a group).
GROUP_COLUMNS = 16
# The gather-dot's entries per program and hidden units per step (a fixed order over H: part of the op's results).
TOKEN_BLOCK = 16
HIDDEN_BLOCK = 128


def _top_k_chunk_rows(columns: int, top_k: int, distinct: bool) -> int | None:
    """Rows per forward chunk (whole row blocks of the statistics kernel) under top_k, None without top_k."""
    if not top_k:
        return None
    width = backend.FORWARD_CONFIG.block_n
    pitch, tiles = stored_layout(columns, width)
    selection = _selection_bytes(columns, width, min(top_k + TOP_K_SLACK, columns), distinct)
    per_row = 2 * pitch + 4 * tiles + selection
    block_m = backend.FORWARD_CONFIG.block_m
    return max(block_m, TOP_K_CHUNK_BYTES // per_row // block_m * block_m)


def _ranks_best_tiles(columns: int, width: int, wanted: int) -> bool:
    """Whether `approximate_candidates` ranks only the best tiles: more whole tiles than candidates, and those
    tiles at most half the columns (otherwise every column is ranked)."""
    return columns // width > wanted and 8 * wanted * width <= 4 * columns


def _selection_bytes(columns: int, width: int, wanted: int, distinct: bool) -> int:
    """Bytes per row `approximate_candidates` allocates: every column in fp32, or the best tiles in fp16, their
    groups' maxima and the best groups' columns in fp32, the partial tile, and the int64 indices; with `distinct`
    the largest rank's int64 keys, their temporary and columns."""
    keys = 24 * columns if distinct else 0
    if not _ranks_best_tiles(columns, width, wanted):
        return 4 * columns + 8 * wanted + keys
    group = _group_columns(width)
    if distinct:
        keys = 24 * (wanted * group + width)
    return 2 * wanted * width + 4 * wanted * (width // group) + 8 * wanted * group + 4 * width + 32 * wanted + keys


def _group_columns(width: int) -> int:
    return GROUP_COLUMNS if width % GROUP_COLUMNS == 0 else width


def statistics_with_squares(
    p: LogProbProblem,
    hidden: Tensor,
    weight: Tensor,
    label_col: Tensor,
    inv_temp: Tensor,
    squares: bool,
    store: StoredLogits | None,
) -> tuple[Partials, Tensor | None]:
    """This rank's partials of `hidden`'s rows and, with `squares`, their square sums relative to the row max: the
    launch of triton_backend.local_statistics with the kernel's SQUARES flag, its splits chosen and merged the same
    way."""
    from . import triton_kernels as kernels

    n = hidden.shape[0]
    c = backend.FORWARD_CONFIG
    row_blocks = -(-n // c.block_m)
    col_tiles = -(-p.valid_columns // c.block_n)
    per = split_layout(p, row_blocks, col_tiles, hidden.device)
    splits = -(-col_tiles // per)
    parts = torch.empty(5 if squares else 4, splits, n, dtype=torch.float32, device=hidden.device)
    kernels.forward_statistics_kernel[(row_blocks * splits,)](
        descriptor(hidden, [c.block_m, c.block_k]),
        descriptor(weight[: p.valid_columns], [c.block_n, c.block_k]),
        label_col,
        inv_temp,
        parts[0],
        parts[1],
        parts[2],
        parts[3],
        None if store is None else descriptor(store.shifted, [c.block_m, c.block_n]),
        None if store is None else store.tile_max,
        n,
        hidden.shape[1],
        p.valid_columns,
        col_tiles,
        per,
        splits,
        BLOCK_M=c.block_m,
        BLOCK_N=c.block_n,
        BLOCK_K=c.block_k,
        GROUP_M=c.group_m,
        ENTROPY=p.calculate_entropy,
        STORE=store is not None,
        num_warps=c.num_warps,
        num_stages=c.num_stages,
        square_ptr=parts[4] if squares else None,
        SQUARES=squares,
    )
    if splits == 1:
        return Partials(*parts[:4, 0]), parts[4, 0] if squares else None
    partials = merge_partials(Partials(*parts[:4].unbind(0)))
    return partials, merge_square_sums(parts[0], parts[1], parts[4], partials.row_max) if squares else None


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


def approximate_candidates(store: StoredLogits, wanted: int, distinct: bool) -> Tensor:
    """The shard columns of each row's `wanted` largest fp16 approximations (raw logit rounded relative to its tile's
    max, plus that max), int64 [rows, wanted], in no particular order; equal approximations by lower column first
    with `distinct` (`top_positions`: the set then depends on the row alone).

    Why not one topk over every column: a tile's approximations never exceed its max, and each tile's max column is
    its max exactly, so the `wanted` largest all lie in the `wanted` tiles of largest max (or in a partial last tile,
    always read); by the same argument within those tiles, in their `wanted` groups of GROUP_COLUMNS columns of
    largest approximation. With `distinct` a tile or group ranks by its max, then by its first column, which keeps
    that argument for equal values. At k=128 of 151936 columns the ranks run over 594 tile maxima, 2304 group maxima
    and 2304 columns instead of 151936 (or 36864, the best tiles' columns). Where the best tiles would not be a
    fraction of the columns (few tiles, large k), every column is ranked."""
    rows, columns = store.shifted.shape
    width = store.tile_columns
    whole = columns // width
    device = store.shifted.device
    if not _ranks_best_tiles(columns, width, wanted):
        approximate = store.shifted.float()  # raw logits to fp16 rounding (their order is z's: T > 0), tile max added
        approximate[:, : whole * width].view(rows, whole, width).add_(store.tile_max[:, :whole, None])
        if columns > whole * width:
            approximate[:, whole * width :].add_(store.tile_max[:, whole : whole + 1])
        return top_positions(approximate, torch.arange(columns, device=device), wanted, distinct)
    group = _group_columns(width)
    per_tile = width // group
    tiles = top_positions(store.tile_max[:, :whole], torch.arange(whole, device=device), wanted, distinct)
    body = store.shifted[:, : whole * width].view(rows, whole, width)
    grouped = body.gather(1, tiles[:, :, None].expand(rows, wanted, width)).view(rows, wanted * per_tile, group)
    tile_max = store.tile_max.gather(1, tiles)
    # fp16 -> fp32 and + max are monotonic: a group's largest approximation is its largest fp16 value's
    group_best = grouped.amax(2).float().view(rows, wanted, per_tile).add_(tile_max[:, :, None])
    group_first = None  # each group's first column, the tie-break of `distinct`
    if distinct:
        group_first = (tiles[:, :, None] * width + torch.arange(0, width, group, device=device)).view(rows, -1)
    groups = top_positions(group_best.view(rows, wanted * per_tile), group_first, wanted, distinct)
    slot = groups // per_tile  # which of the row's best tiles
    approximate = grouped.gather(1, groups[:, :, None].expand(rows, wanted, group)).float()
    approximate = approximate.add_(tile_max.gather(1, slot)[:, :, None]).view(rows, wanted * group)
    first_column = tiles.gather(1, slot) * width + groups % per_tile * group  # [rows, wanted]
    key_columns = (first_column[:, :, None] + torch.arange(group, device=device)).view(rows, -1) if distinct else None
    if columns > whole * width:  # the partial last tile, whole
        tail = store.shifted[:, whole * width :].float().add_(store.tile_max[:, whole : whole + 1])
        approximate = torch.cat([approximate, tail], 1)
        if distinct:
            tail_columns = torch.arange(whole * width, columns, device=device).expand(rows, -1)
            key_columns = torch.cat([key_columns, tail_columns], 1)
    best = top_positions(approximate, key_columns, wanted, distinct)
    in_groups = best < wanted * group
    from_group = first_column.gather(1, (best // group).clamp_max(wanted - 1)) + best % group
    return torch.where(in_groups, from_group, best - wanted * group + whole * width)


def top_candidates(
    store: StoredLogits,
    hidden: Tensor,
    weight: Tensor,
    inv_temp: Tensor,
    top_k: int,
    vocab_start: int,
    distinct: bool,
) -> tuple[Tensor, Tensor]:
    """The shard's top_k (exact fp32 logits, global ids; -inf / -1 padding) of the rows whose logits `store` kept;
    `distinct` as in `approximate_candidates`."""
    columns = store.shifted.shape[1]
    candidates = approximate_candidates(store, min(top_k + TOP_K_SLACK, columns), distinct)
    exact = token_logits(hidden, weight, candidates, inv_temp)
    values, ids = select_top(exact, candidates + vocab_start, min(top_k, columns))
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
        self.store = None
        chunk = spans[0].stop - spans[0].start if spans else 0
        if request is not None and request.top_k and chunk and valid_columns:
            pitch, tiles = stored_layout(valid_columns, backend.FORWARD_CONFIG.block_n)
            self.store = StoredLogits(
                torch.empty(chunk, pitch, dtype=torch.float16, device=weight.device)[:, :valid_columns],
                torch.empty(chunk, tiles, dtype=torch.float32, device=weight.device),
                backend.FORWARD_CONFIG.block_n,
            )

    def blocks(self) -> Iterator[RowBlock]:
        b = self.block
        for span in self.spans:
            yield RowBlock(span, b.rows[span], b.hidden[span], b.label_col[span], b.inv_temp[span])

    def token_statistics(self, block: RowBlock) -> tuple[Partials, TokenPartials]:
        p, request, count = self.p, self.request, block.rows.numel()
        store = None
        if self.store is not None:
            store = StoredLogits(self.store.shifted[:count], self.store.tile_max[:count], self.store.tile_columns)
        partials, squares = statistics_with_squares(
            p, block.hidden, self.weight, block.label_col, block.inv_temp, request.sum_squares, store
        )
        logits = top_values = top_ids = None
        if request.token_columns is not None:
            logits = token_logits(block.hidden, self.weight, request.token_columns[block.span], block.inv_temp)
        if store is not None:
            top_values, top_ids = top_candidates(
                store, block.hidden, self.weight, block.inv_temp, request.top_k, p.vocab_start, p.batch_invariant
            )
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
    chunk = _top_k_chunk_rows(p.valid_columns, request.top_k, p.batch_invariant) or max(active, 1)
    spans = [slice(start, min(start + chunk, active)) for start in range(0, active, chunk)]
    return TritonTokenPasses(p, p.valid_columns, tma_ready(p.weight), block, request, spans)
