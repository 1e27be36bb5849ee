"""The selected-token math in torch, written once: what `token_log_probs` adds to the softmax statistics.

Per scored row and over this rank's valid columns, a backend's block returns, beside its `Partials`, a
`TokenPartials`: the logits of the asked ids that fall on this shard (fp32, z = h . W[id] / T, 0 elsewhere), the
square sum q = sum_j e^(2 (z_j - m)) relative to the shard's row max m (for sum pi^2), and the shard's top
candidates (their logits and global ids, highest first). Across ranks (`merge_token_partials`): the logits are one
rank's value plus exact zeros, q is rescaled to the global max like the sum-exp and added in rank order, and the
candidates are gathered and selected again (with one rank they are already in order).

The gradient of sum_j c_j log p(id_j) with respect to the logits is sum_j c_j e_(id_j) - (sum_j c_j) p: a dense
part, the label gradient's with coefficient sum_j c_j, plus a sparse part at k columns per row
(`SparseLogitGradient`). Before it is added, duplicate columns are combined (`combine_duplicate_columns`, or the
Triton backend's kernel in the same order), onto the first occurrence, so that adding it needs no atomics and its
result no order.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .softmax_math import ordered_sum


class TokenRequest(NamedTuple):
    """What `token_log_probs` asks of a backend beyond the statistics, over the scored rows.

    token_columns: int64 [A, k] each asked id as a column of this shard, -1 where another rank (or none) holds it
    (None: no ids asked); top_k: the row's top candidates to return (0: none); sum_squares: the square sum q;
    chunk_bytes: the memory a chunk of rows may hold under top_k where a backend chunks (None: its default)."""

    token_columns: Tensor | None
    top_k: int
    sum_squares: bool
    chunk_bytes: int | None = None


class TokenPartials(NamedTuple):
    """A block's shard-local extras, per row (None where not asked).

    token_logits: fp32 [R, k] z of the asked ids on this shard, 0 elsewhere; square_sum: fp32 [R]
    sum e^(2 (z - m)) relative to the shard's row max m (the Partials' row_max); top_logits / top_ids: fp32 / int64
    [R, top_k] the shard's largest logits and their global ids in select_top's order (highest first, equal logits by
    lower id), -inf / -1 past the shard's valid columns."""

    token_logits: Tensor | None
    square_sum: Tensor | None
    top_logits: Tensor | None
    top_ids: Tensor | None


class TokenResults(NamedTuple):
    """Merged over every rank, per scored row: token log-probs [A, k], top ids / log-probs [A, top_k], sum pi^2."""

    token_log_probs: Tensor | None
    top_ids: Tensor | None
    top_log_probs: Tensor | None
    sum_pi_squared: Tensor | None


class SparseLogitGradient(NamedTuple):
    """The sparse part of a block's d_logits: per row, `columns` int64 [R, m] of this shard (a column may repeat;
    -1: nothing) get `coefficients` fp32 [R, m] / T added."""

    columns: Tensor
    coefficients: Tensor


def gather_token_logits(z: Tensor, token_columns: Tensor) -> Tensor:
    """fp32 [R, k]: z at each row's asked columns, 0 where the column is -1 (another rank's)."""
    picked = z.gather(1, token_columns.clamp_min(0))
    return torch.where(token_columns >= 0, picked, torch.zeros_like(picked))


def square_sum(z: Tensor) -> Tensor:
    """fp32 [R]: sum_j e^(2 (z_j - m)) with m the row max of z [R, C] (C >= 1)."""
    shifted = z - z.amax(dim=1, keepdim=True)
    return shifted.mul_(2).exp_().sum(dim=1)


def top_positions(values: Tensor, columns: Tensor | None, wanted: int, distinct: bool) -> Tensor:
    """Positions of the `wanted` largest of [R, c] `values` per row, in no particular order. torch.topk may break
    ties differently by the number of rows (its CUDA kernel picks an algorithm by it); with `distinct` equal values
    rank by lower `columns` (int64, broadcastable to values, distinct within a row; unused without `distinct`)
    first, so the set chosen is a function of the row alone (batch_invariant), for a topk over int64 keys."""
    if not distinct:
        return torch.topk(values, wanted, dim=1, sorted=False).indices
    keys = values.float().view(torch.int32).to(torch.int64)
    keys.bitwise_xor_((keys >> 63) & 0x7FFFFFFF)  # fp32 order as signed integers: negatives' magnitudes mirrored
    keys.mul_(2**32).add_(2**32 - 1).sub_(columns)  # then lower column first
    return torch.topk(keys, wanted, dim=1, sorted=False).indices


def shard_top_candidates(z: Tensor, top_k: int, vocab_start: int, distinct: bool) -> tuple[Tensor, Tensor]:
    """The `top_k` largest logits of z [R, C] and their global ids in select_top's order, padded with -inf / -1 past
    C columns; equal logits at the boundary by lower id first with `distinct` (`top_positions`)."""
    columns = torch.arange(z.shape[1], device=z.device)
    wanted = min(top_k, z.shape[1])
    positions = top_positions(z, columns, wanted, distinct)
    return pad_candidates(*select_top(z.gather(1, positions), positions + vocab_start, wanted), top_k)


def pad_candidates(values: Tensor, ids: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Widen [R, c] candidates to [R, top_k] with -inf logits and id -1."""
    missing = top_k - values.shape[1]
    if missing <= 0:
        return values, ids
    rows = values.shape[0]
    return (
        torch.cat([values, values.new_full((rows, missing), float("-inf"))], 1),
        torch.cat([ids, ids.new_full((rows, missing), -1)], 1),
    )


def no_column_token_partials(rows: int, request: TokenRequest, device: torch.device) -> TokenPartials:
    """The extras of a shard without valid columns (or of no rows): nothing on it."""
    k = 0 if request.token_columns is None else request.token_columns.shape[1]
    zeros = torch.zeros(rows, dtype=torch.float32, device=device)
    top = request.top_k
    return TokenPartials(
        torch.zeros(rows, k, dtype=torch.float32, device=device) if request.token_columns is not None else None,
        zeros if request.sum_squares else None,
        torch.full((rows, top), float("-inf"), device=device) if top else None,
        torch.full((rows, top), -1, dtype=torch.int64, device=device) if top else None,
    )


def select_top(values: Tensor, ids: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """The `top_k` largest of [R, c] candidates, highest first; equal logits ordered by lower id first (two stable
    sorts), so the order never depends on where a candidate came from."""
    by_id = torch.sort(ids, dim=1, stable=True)
    values = values.gather(1, by_id.indices)
    by_value = torch.sort(values, dim=1, descending=True, stable=True)
    keep = by_value.indices[:, :top_k]
    return by_value.values[:, :top_k], by_id.values.gather(1, keep)


def gather_ranks(mine: Tensor, tp_group, tp_world_size: int) -> Tensor:
    """[tp, *mine.shape]: every rank's `mine`, in rank order: a SUM all-reduce of each rank's tensor in its own slot
    and zeros elsewhere, exact (x + 0 is x, -inf + 0 is -inf) and available wherever all-reduce is (gloo has no
    all-gather of CUDA tensors), as combine_row_statistics gathers the partials."""
    slots = mine.new_zeros((tp_world_size, *mine.shape))
    slots[dist.get_rank(tp_group)] = mine
    dist.all_reduce(slots, op=dist.ReduceOp.SUM, group=tp_group)
    return slots


def merge_token_partials(
    partials: TokenPartials, row_max: Tensor, local_max: Tensor, log_sum: Tensor, tp_group, tp_world_size: int
) -> TokenResults:
    """Merge a shard's extras with the other ranks', given the merged statistics: the global `row_max` M, this
    shard's `local_max` m and the global log sum e^(z - M). Every rank gathers every rank's extras (`gather_ranks`)
    and merges them in rank order: the ids' logits are one rank's value plus exact zeros, the square sums are
    rescaled to M and added in an order fixed by the TP size (`ordered_sum`), the ranks' top candidates are
    selected again. Every rank returns the same values, and a row's values do not depend on the other rows."""
    token_logits, squares, top_values, top_ids = partials
    if squares is not None:
        has_mass = torch.isfinite(local_max)
        rescale = torch.exp(2 * (torch.where(has_mass, local_max, row_max) - row_max))
        squares = torch.where(has_mass, squares * rescale, torch.zeros_like(squares))
    if tp_world_size > 1:
        gathered = gather_ranks(
            torch.cat(
                [t.unsqueeze(1) if t.dim() == 1 else t for t in (squares, token_logits, top_values) if t is not None], 1
            ),
            tp_group,
            tp_world_size,
        )
        widths = [1 if t.dim() == 1 else t.shape[1] for t in (squares, token_logits, top_values) if t is not None]
        pieces = list(gathered.split(widths, dim=2))
        if squares is not None:
            squares = ordered_sum(pieces.pop(0).squeeze(2))
        if token_logits is not None:
            token_logits = ordered_sum(pieces.pop(0))
        if top_values is not None:
            top_values = torch.cat(pieces.pop(0).unbind(0), 1)
            top_ids = torch.cat(gather_ranks(top_ids, tp_group, tp_world_size).unbind(0), 1)
    log_z = (row_max + log_sum).unsqueeze(1)
    # q / s^2 with s = e^(log_sum): both relative to M, so no overflow at any logit magnitude
    sum_pi_squared = None if squares is None else torch.exp(squares.log() - 2 * log_sum)
    token_log_probs = None if token_logits is None else token_logits - log_z
    top_log_probs = None
    if top_values is not None:
        if tp_world_size > 1:  # each rank's candidates in order; the ranks' together not
            top_values, top_ids = select_top(top_values, top_ids, partials.top_logits.shape[1])
        top_log_probs = top_values - log_z
    return TokenResults(token_log_probs, top_ids, top_log_probs, sum_pi_squared)


def combine_duplicate_columns(columns: Tensor, coefficients: Tensor) -> SparseLogitGradient:
    """Each row's coefficients of equal columns summed onto the column's first occurrence (the later ones become
    -1 with coefficient 0); columns -1 stay -1 with coefficient 0.

    Why sorted: a stable sort makes equal columns neighbours in their original order, so each run's sum is a
    segmented suffix scan over [R, m] in ceil(log2 m) steps (comparing every pair took [R, m, m]: 2048 x 129 x 129 a
    call at k=128). A run's terms are added in an order fixed by its length and place in the row (the row's own
    values only): a pair's sum is a + b in either order, three terms (a + b) + c; a lone coefficient is c + 0."""
    m = columns.shape[1]
    ordered, order = torch.sort(columns, dim=1, stable=True)
    sums = coefficients.gather(1, order)
    step = 1
    while step < m:  # sums[j] = the run's terms from j to j + 2 step - 1
        same_run = ordered[:, step:] == ordered[:, :-step]
        sums = torch.cat([torch.where(same_run, sums[:, :-step] + sums[:, step:], sums[:, :-step]), sums[:, -step:]], 1)
        step *= 2
    owner = torch.ones_like(ordered, dtype=torch.bool)
    owner[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    owner &= ordered >= 0
    out_columns = torch.empty_like(columns).scatter_(1, order, torch.where(owner, ordered, -1))
    out_coefficients = torch.empty_like(coefficients).scatter_(1, order, torch.where(owner, sums + 0.0, 0.0))
    return SparseLogitGradient(out_columns, out_coefficients)


def add_sparse_gradient(grad: Tensor, sparse: SparseLogitGradient, inv_temp: Tensor) -> Tensor:
    """grad [R, C] (fp32 d_logits of the raw logits) plus coefficient / T at each row's columns, in place. The columns
    are combined first (unique per row) and -1 entries add an exact 0 at column 0, so the result is the same in any
    order."""
    sparse = combine_duplicate_columns(*sparse)
    columns = sparse.columns.clamp_min(0)
    values = torch.where(sparse.columns >= 0, sparse.coefficients * inv_temp.unsqueeze(1), 0.0)
    return grad.scatter_add_(1, columns, values)
