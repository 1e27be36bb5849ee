"""Where the loss-inside op's chunks of scored rows begin and end, or that it takes the two-pass path instead.

Why: a chunk's logits are kept from its statistics to its gradients, memory the two-pass op never needs, so
the chunk is sized from the budget and, on CUDA, from the memory free at the call; a job that fits with the
two-pass op must not run out of memory because the loss is inside. A sequence-level loss (GSPO, geo_mean)
differentiates a row correctly only once its whole sequence is computed, so with `row_groups` chunk
boundaries fall between groups. When neither works (no chunk of the smallest size fits, or a group is longer
than a chunk; or, loss_inside.py, the planned buffers cannot be allocated) the call takes the two-pass path, with
a warning once per loss and reason. Under tensor
parallelism every rank must walk the same chunks: one MIN all-reduce per call agrees on them.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..log_once import log_once
from .arguments import LogProbProblem

logger = logging.getLogger(__name__)

# What the call allocates beside everything counted below (cuBLAS workspaces of the main and the evaluation
# stream, the caching allocator's rounding and fragmentation): held back from the free memory.
FREE_MEMORY_MARGIN_BYTES = 256 * 1024**2
# Per row of the call, scored or not: the driver's four fp32 vectors (log-probs, entropy, the gradients used)
# and room for ~60 fp32 temporaries of loss_fn's per-chunk and final evaluations.
ROW_VECTOR_BYTES = 256
GIB = 1024**3


@dataclass(frozen=True)
class ChunkCost:
    """A backend's memory for the loss-inside passes. stored_row_bytes: what the budget limits, the logits kept
    per scored row; transient_row_bytes: the rest of a scored row's bytes while its chunk is processed;
    fixed_bytes: the passes' own buffers whatever the chunking (a weight copy); min_rows: the smallest chunk
    worth running when memory is short (fewer rows: the two-pass path); row_multiple: chunks sized from a
    budget or from free memory are whole multiples of it; budget_bytes: the default budget."""

    stored_row_bytes: int
    transient_row_bytes: int
    fixed_bytes: int
    min_rows: int
    row_multiple: int
    budget_bytes: int

    @property
    def row_bytes(self) -> int:
        return self.stored_row_bytes + self.transient_row_bytes


@dataclass(frozen=True)
class RowGroups:
    """The scored rows as units no chunk boundary splits: a group's run of scored rows, or one scored row of no
    group. lengths, groups: host int64 [units] (group -1: no group); error: why row_groups is refused, or None."""

    lengths: torch.Tensor
    groups: torch.Tensor
    error: str | None

    def fingerprint(self) -> int:
        """Identical on ranks whose units are identical (what the chunks depend on); 0 is 'no row_groups'."""
        return zlib.crc32(self.lengths.numpy().tobytes()) + 1


def available_bytes(device: torch.device, enough: int | None = None) -> int | None:
    """Bytes the call can still allocate on `device` in large pieces: on CUDA the driver's free memory plus the
    cached blocks PyTorch's caching allocator can hand back to it (reserved, unallocated, and not a free piece of a
    segment still partly in use: such "inactive split" memory serves only requests that fit the piece, and a chunk
    of stored logits or the fp32 d_weight accumulator is gigabytes); None elsewhere (no query: the budget alone
    sizes the chunk). With `enough`, the driver's free memory alone when it reaches that: the allocator's
    statistics, read only when the cache could matter, cost more host time than the rest of the plan (the GPU
    waits for it). Tests replace this function to simulate a GPU short of memory."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    if enough is not None and free >= enough:
        return free
    stats = torch.cuda.memory_stats_as_nested_dict(device)  # one query (memory_reserved etc. flatten it each)
    current = lambda name: stats.get(name, {}).get("all", {}).get("current", 0)  # noqa: E731
    cached = current("reserved_bytes") - current("allocated_bytes")
    return free + max(0, cached - current("inactive_split_bytes"))


def check_row_groups(row_groups, labels: torch.Tensor) -> None:
    """ValueError naming row_groups unless it is None or an integer tensor shaped like labels."""
    if row_groups is None:
        return
    if not isinstance(row_groups, torch.Tensor):
        raise ValueError(
            f"row_groups: expected None or an int64 tensor shaped like labels, got {type(row_groups).__name__}"
        )
    if row_groups.dtype.is_floating_point or row_groups.dtype.is_complex or row_groups.dtype == torch.bool:
        raise ValueError(
            f"row_groups: must be an integer tensor (group ids; negative: no group), got {row_groups.dtype}"
        )
    if row_groups.shape != labels.shape or row_groups.device.type == "meta":
        raise ValueError(f"row_groups: must be shaped like labels {tuple(labels.shape)}, got {tuple(row_groups.shape)}")


def row_group_units(row_groups: torch.Tensor, p: LogProbProblem) -> RowGroups:
    """The units of the scored rows (flattened labels order), and an error when a group's scored rows are not
    contiguous there (one host copy of the unit lengths)."""
    groups = row_groups.reshape(-1).to(device=p.active_rows.device, dtype=torch.int64).index_select(0, p.active_rows)
    starts = torch.ones_like(groups, dtype=torch.bool)
    starts[1:] = (groups[1:] != groups[:-1]) | (groups[1:] < 0)
    first = starts.nonzero().squeeze(1)
    lengths = torch.diff(first, append=first.new_tensor([groups.numel()]))
    unit_groups = groups.index_select(0, first).clamp_min(-1)
    lengths, unit_groups, first = torch.stack([lengths, unit_groups, first]).cpu()  # one copy: each one waits
    grouped = (unit_groups >= 0).nonzero().squeeze(1)
    ids, order = unit_groups[grouped].sort(stable=True)
    repeated = (ids[1:] == ids[:-1]).nonzero()
    error = None
    if repeated.numel():
        k = int(repeated[0, 0])
        unit_a, unit_b = int(grouped[order[k]]), int(grouped[order[k + 1]])
        rows = p.active_rows.cpu()
        error = (
            f"row_groups: the scored rows of group {int(ids[k])} are not contiguous in the op's row order (flattened "
            f"labels): scored row {int(rows[first[unit_a + 1]])} of another group (or of none) lies between its rows "
            f"{int(rows[first[unit_a] + lengths[unit_a] - 1])} and {int(rows[first[unit_b]])}. Each group's scored "
            f"rows "
            "must be contiguous (packed sequences, or [batch, seq] with the batch first)"
        )
    return RowGroups(lengths, unit_groups, error)


def log_fallback(loss_name: str, reason: str, message: str) -> None:
    """A warning the first time a loss falls back for a reason; later calls at debug level."""
    log_once(logger, message, logging.WARNING, key=(loss_name, reason), later=logging.DEBUG)


def _size(count: int) -> str:
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 1024**2:.1f} MiB"


def equal_piece_rows(rows: int, most: int, multiple: int = 1) -> int:
    """Rows per piece when `rows` are cut into as few pieces of at most `most` as will do, every piece as long as
    that count allows, rounded up to a `multiple` (whole row blocks, `most` itself being one): the last piece is
    the shortest."""
    per_piece = -(-rows // -(-rows // most))
    return -(-per_piece // multiple) * multiple


def _round_down(rows: int, multiple: int) -> int:
    return rows // multiple * multiple if rows >= multiple else rows


class RankAgreement(NamedTuple):
    """What every rank of tp_group agreed on: every rank takes one chunk (`one_chunk`), the smallest capacity
    (`rows`), some rank refused its row_groups (`refused`), the ranks' units differ (`differ`)."""

    one_chunk: bool
    rows: int
    refused: bool
    differ: bool


def _agree(p: LogProbProblem, one: bool, rows: int, groups: RowGroups | None) -> RankAgreement:
    """From one MIN all-reduce over tp_group; this rank's own values with one rank."""
    fingerprint = 0 if groups is None else groups.fingerprint()
    valid = groups is None or groups.error is None
    if p.tp_world_size == 1:
        return RankAgreement(one, rows, not valid, False)
    mine = torch.tensor(
        [int(one), rows, fingerprint, -fingerprint, int(valid)], dtype=torch.int64, device=p.hidden.device
    )
    dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=p.tp_group)
    every_one, smallest, low, minus_high, every_valid = mine.tolist()
    return RankAgreement(bool(every_one), smallest, not every_valid, low != -minus_high)


def plan_chunks(
    p: LogProbProblem,
    cost: ChunkCost | None,
    *,
    want_grads: bool,
    chunk_rows: int | None,
    chunk_bytes: int | None,
    groups: RowGroups | None,
    loss_name: str,
) -> list[slice] | None:
    """The chunks of one call, as slices of its scored rows; None: run the two-pass path. cost None: the backend
    runs every scored row in one block (nothing kept).

    Capacity: `chunk_rows`, else the budget (`chunk_bytes` or the backend's) of stored logits, and on CUDA no
    more than the free memory holds beside the outputs, the per-row vectors, the margin and, with more than one
    chunk, the fp32 d_weight accumulator. One chunk holds every scored row when its peak is no more than a
    budget chunk's plus that accumulator (and it fits). Chunks are equal, or of `chunk_rows` as asked, or with
    row groups whole groups in as few chunks as greedy packing needs, cut near equal shares (`_packed`)."""
    active, h = p.active_rows.numel(), p.hidden.shape[1]
    one, rows, bound, available = True, max(active, 1), "every scored row", None
    if cost is not None:
        accumulator = 4 * p.valid_columns * h if want_grads and p.weight.dtype != torch.float32 else 0
        fixed = cost.fixed_bytes + ROW_VECTOR_BYTES * p.num_rows + FREE_MEMORY_MARGIN_BYTES
        if want_grads:
            fixed += p.hidden.numel() * p.hidden.element_size() + p.weight.numel() * p.weight.element_size()
        if chunk_rows is not None:
            rows, bound = chunk_rows, f"chunk_rows={chunk_rows}"
            one = chunk_rows >= active
        else:
            budget = chunk_bytes or cost.budget_bytes
            rows, bound = (
                max(cost.row_multiple, _round_down(budget // cost.stored_row_bytes, cost.row_multiple)),
                (f"the {_size(budget)} budget"),
            )
            one = active * cost.row_bytes <= budget * cost.row_bytes // cost.stored_row_bytes + accumulator
        requested = rows
        # free memory that leaves every decision below as the budget alone makes it (a chunk of whole multiples):
        # the plan then needs no more precise reading
        whole = -(-rows // cost.row_multiple) * cost.row_multiple
        enough = fixed + max(active * cost.row_bytes if one else 0, accumulator + whole * cost.row_bytes)
        available = available_bytes(p.hidden.device, enough)
        if available is not None:
            room = available - fixed
            one = one and active * cost.row_bytes <= room
            fit = _round_down(max(0, room - accumulator) // cost.row_bytes, cost.row_multiple)
            if fit < rows:
                rows, bound = fit, f"free memory ({_size(available)})"
    agreed = _agree(p, one, rows, groups)
    if agreed.rows < rows:
        bound = "the free memory of another rank of tp_group"
    rows = agreed.rows
    if agreed.refused:
        raise ValueError(
            groups.error
            if groups is not None and groups.error
            else "row_groups: another rank of tp_group refused its row_groups (see its error); every rank "
            "must pass the same row_groups"
        )
    if agreed.differ:
        raise ValueError(
            "row_groups: every rank of tp_group must pass the same row_groups (as the same rows); "
            "the ranks' groups of scored rows differ"
        )
    if agreed.one_chunk or active == 0:
        logger.debug("log_probs_entropy_and_loss: loss %s: %d scored rows in one chunk", loss_name, active)
        return [slice(0, active)] if active else []
    minimal = min(cost.min_rows, active, requested)
    if rows < minimal:
        need = fixed + accumulator + minimal * cost.row_bytes
        elsewhere = available is not None and available >= need
        log_fallback(
            loss_name,
            "memory",
            (
                f"log_probs_entropy_and_loss: loss {loss_name}: too little free GPU memory for a chunk of {minimal} "
                f"rows: "
                f"{_size(need)} needed ({_size(minimal * cost.row_bytes)} for the chunk, {_size(accumulator)} for the "
                f"fp32 "
                f"d_weight accumulator, {_size(fixed)} for the gradients, per-row vectors and the "
                f"{_size(FREE_MEMORY_MARGIN_BYTES)} margin), {_size(available or 0)} free on {p.hidden.device}"
                f"{' (this rank; another rank of tp_group has less)' if elsewhere else ''}; this call runs the "
                f"two-pass "
                "path (logits recomputed in backward)"
            ),
        )
        return None
    rows = min(rows, active)
    if groups is not None and want_grads:
        longest = int(groups.lengths.argmax())
        if int(groups.lengths[longest]) > rows:
            log_fallback(
                loss_name,
                "group",
                (
                    f"log_probs_entropy_and_loss: loss {loss_name}: row group {int(groups.groups[longest])} has "
                    f"{int(groups.lengths[longest])} scored rows, more than a chunk holds ({rows} rows, set by "
                    f"{bound}); "
                    "this call runs the two-pass path (logits recomputed in backward). A larger chunk_bytes or "
                    "chunk_rows keeps such sequences in the fused loss"
                ),
            )
            return None
        spans = _packed(groups.lengths, rows)
    elif rows == chunk_rows:  # as asked (every rank: the same arguments, the same agreed rows)
        spans = [slice(start, min(start + rows, active)) for start in range(0, active, rows)]
    else:
        size = equal_piece_rows(active, rows)
        spans = [slice(start, min(start + size, active)) for start in range(0, active, size)]
    logger.debug(
        "log_probs_entropy_and_loss: loss %s: %d scored rows in %d chunks of up to %d rows (set by %s)",
        loss_name,
        active,
        len(spans),
        max(s.stop - s.start for s in spans),
        bound,
    )
    return spans


def _packed(lengths: torch.Tensor, capacity: int) -> list[slice]:
    """Whole units, in order, in as few chunks as greedy packing up to `capacity` rows needs, each chunk cut at the
    unit end nearest an equal share of the rows: the last chunk's gradient GEMMs are what the final loss evaluation
    overlaps, and greedy packing can leave a last chunk of one short sequence (greedy's chunks where no such cut
    fits the capacity). Rows of no group are units of one, maybe thousands: searches, no loop over units."""
    ends = lengths.cumsum(0).numpy()
    greedy = _greedy(ends, capacity)
    count, total = len(greedy), int(ends[-1])
    spans, start = [], 0
    for index in range(1, count):
        share = total * index / count
        first, last = int(ends.searchsorted(start, "right")), int(ends.searchsorted(start + capacity, "right")) - 1
        nearest = min(max(int(ends.searchsorted(share)), first), last)
        cut = min(
            (int(ends[i]) for i in (nearest - 1, nearest) if first <= i <= last), key=lambda end: abs(end - share)
        )
        spans.append(slice(start, cut))
        start = cut
    if total - start > capacity:
        return greedy
    return spans + [slice(start, total)]


def _greedy(ends, capacity: int) -> list[slice]:
    """As many whole units per chunk as fit in `capacity` rows, in order (`ends`: the units' cumulative row ends, a
    sorted numpy array; each unit fits alone)."""
    spans, start, total = [], 0, int(ends[-1])
    while start < total:
        stop = int(ends[int(ends.searchsorted(start + capacity, "right")) - 1])
        spans.append(slice(start, stop))
        start = stop
    return spans
