"""The ops' arguments: every check, and their normalization into the one `LogProbProblem` every backend receives.

`build_problem` validates the user's arguments once and hands the drivers this flat, checked description, so a
backend only does arithmetic.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..checks import check_bool, check_int, is_number
from .tensor_parallel import check_tp_hidden, full_hidden
from .weight_gradient import check_main_grad

logger = logging.getLogger(__name__)

# Groups whose ranks have been seen to agree on the row counts (checked on a group's first call, and on
# every call while this module's logger is at DEBUG): a mismatch would hang the first collective.
_row_counts_checked: set = set()

# One fp32 logits tile [tile_rows, V_local] is sized to stay near this budget.
TILE_BUDGET_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class LogProbProblem:
    """Rows of hidden states against one rank's vocabulary shard.

    hidden: [N, H], every row (gathered already under sequence parallelism); weight: [V_local, H];
    labels: [N] global ids (only rows in `active_rows` are read); temperature: a float or an fp32
    [N] tensor; active_rows: int64 indices of the rows to compute (sorted, unique);
    vocab_start: first global id held by this rank; valid_columns: how many of
    this rank's columns are real vocabulary (the rest is Megatron's padding);
    label_is_max: None, or a bool [N] buffer (all False) that the statistics
    merge fills at the scored rows with "the label's logit is the row maximum",
    so acceptance needs no logits and no backend change; vocab_size: the true
    global vocabulary (None: V_local * tp size, no padding anywhere);
    keep_logits_bytes: memory the two-pass op may hold from forward to backward to keep scored
    rows' logits (fp16) instead of recomputing them (0: recompute every row); main_grad_dtype: None, or the
    dtype of `weight.main_grad`, which the two-pass op's backward adds d_weight into (weight_gradient.py);
    batch_invariant: a row's forward values must not depend on the rest of the batch (the portable backend refuses
    it on CUDA, its top-k then takes the lower ids among ties; the Triton forward is invariant either way, its
    top-k takes the lower ids always); label_check: None when the labels were checked before the problem was
    made, else the check still under way (`PendingLabelCheck`): active_rows then ignore no label, and the labels,
    not yet known to lie in range, must only be compared with column ids until the caller's `finish()`.
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    temperature: float | torch.Tensor
    active_rows: torch.Tensor
    vocab_start: int
    valid_columns: int
    tp_group: dist.ProcessGroup | None
    tp_world_size: int
    calculate_entropy: bool
    tile_rows: int
    label_is_max: torch.Tensor | None = None
    vocab_size: int | None = None
    keep_logits_bytes: int = 0
    main_grad_dtype: torch.dtype | None = None
    batch_invariant: bool = False
    label_check: PendingLabelCheck | None = None

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and (self.hidden.requires_grad or self.weight.requires_grad)

    @property
    def padded_vocabulary(self) -> bool:
        """Whether some rank's shard ends in padding columns (vocab_size < V_local * tp size)."""
        return self.vocab_size is not None and self.vocab_size < self.weight.shape[0] * self.tp_world_size


def default_tile_rows(local_vocab: int) -> int:
    """Rows per tile so that one fp32 [rows, V_local] logits tile is ~TILE_BUDGET_BYTES."""
    return max(1, TILE_BUDGET_BYTES // (4 * max(1, local_vocab)))


def _tp_layout(tp_group) -> tuple[int, int]:
    if tp_group is not None and not isinstance(tp_group, dist.ProcessGroup):
        raise ValueError(f"tp_group: expected a torch.distributed ProcessGroup or None, got {type(tp_group).__name__}")
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        if tp_group is not None:
            raise ValueError(
                "tp_group was given but torch.distributed is not initialized; pass tp_group=None for one rank"
            )
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def check_temperature_values(field: str, temperature, *, read_values: bool = True) -> None:
    """ValueError naming `field` unless `temperature` is a finite number > 0 or a floating tensor of such values.
    read_values=False: a tensor's values are left to the caller (`bad_temperatures`), which reads them together
    with its other checks: reading a CUDA tensor's values waits for the GPU."""
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point():
            raise ValueError(f"{field}: a tensor must be floating point, got {temperature.dtype}")
        if temperature.device.type == "meta":
            raise ValueError(
                f"{field}: a tensor on the meta device holds no values; pass it on the CPU or the model's device"
            )
        if temperature.requires_grad:
            raise ValueError(
                f"{field}: requires grad, but no gradient flows to the temperature; pass temperature.detach()"
            )
        if read_values and bool(bad_temperatures(temperature)):
            raise ValueError(f"{field}: every value must be finite and > 0")
        return
    if not is_number(temperature):
        raise ValueError(f"{field}: expected a float > 0 or a tensor, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"{field}: must be finite and > 0, got {temperature}")


def bad_temperatures(temperature: torch.Tensor) -> torch.Tensor:
    """0-d bool on the tensor's device: some value is not finite or not > 0 (not read here)."""
    return (~torch.isfinite(temperature) | (temperature <= 0)).any()


def _check_temperature(temperature, labels: torch.Tensor, device: torch.device) -> float | torch.Tensor:
    """A float, or an fp32 [N] tensor of per-row temperatures (its values checked by the caller's one read)."""
    check_temperature_values("temperature", temperature, read_values=False)
    if not isinstance(temperature, torch.Tensor):
        return float(temperature)
    if temperature.dim() == 0:
        check_temperature_values("temperature", temperature)
        return float(temperature.item())
    if temperature.shape != labels.shape:
        raise ValueError(
            f"temperature: a tensor must be 0-d or shaped like labels {tuple(labels.shape)}, got "
            f"{tuple(temperature.shape)}"
        )
    return temperature.reshape(-1).to(device=device, dtype=torch.float32)


def _check_tensor(field: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{field}: expected a torch.Tensor, got {type(value).__name__}")
    if value.device.type == "meta":
        raise ValueError(f"{field}: a tensor on the meta device holds no values")


def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def row_counts_checked(tp_group) -> bool:
    """Whether `check_row_counts_agree` would skip `tp_group` now (counting the scored rows reads the GPU)."""
    return tp_group in _row_counts_checked and not logger.isEnabledFor(logging.DEBUG)


def check_row_counts_agree(tp_group, device: torch.device, num_rows: int, scored_rows: int) -> None:
    """ValueError naming every rank's row counts when the ranks of `tp_group` disagree.

    Every rank must pass the same rows (the collectives exchange per-row
    statistics); otherwise the first collective waits forever. One small
    all-gather on a group's first call, and on every call at DEBUG level.
    """
    if row_counts_checked(tp_group):
        return
    mine = torch.tensor([num_rows, scored_rows], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(everyone, mine, group=tp_group)
    counts = [tuple(int(x) for x in rank_counts.tolist()) for rank_counts in everyone]
    if any(c != counts[0] for c in counts):
        per_rank = ", ".join(f"rank {rank}: {n} rows ({k} scored)" for rank, (n, k) in enumerate(counts))
        raise ValueError(
            f"hidden/labels/score_mask: every rank of tp_group must pass the same rows and the same scored rows, got "
            f"{per_rank}"
        )
    _row_counts_checked.add(tp_group)


def build_problem(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor,
    tp_group: dist.ProcessGroup | None,
    score_mask: torch.Tensor | None,
    ignore_index: int,
    vocab_size: int | None,
    calculate_entropy: bool,
    tile_rows: int | None,
    return_label_is_max: bool = False,
    tp_hidden: str = "replicated",
    keep_logits_bytes: int = 0,
    gradient_accumulation_fusion: bool = False,
    batch_invariant: bool = False,
    defer_label_check: bool = False,
) -> LogProbProblem:
    """The checked, flattened problem of `log_probs_and_entropy`'s arguments (every op entry point shares it).

    Under tensor parallelism its `hidden` holds every row, wired per `tp_hidden` (tensor_parallel.py) so
    that the op's backward completes d_hidden; the gather of "sequence_sharded" runs after every check.
    defer_label_check: the labels' values are checked after the caller's kernels (`PendingLabelCheck`), not here;
    a score_mask on the host then picks the rows without reading the GPU either."""
    check_tp_hidden(tp_hidden)
    for field, value in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        _check_tensor(field, value)
    if score_mask is not None:
        _check_tensor("score_mask", score_mask)
    check_int("ignore_index", ignore_index)
    check_bool("calculate_entropy", calculate_entropy)
    if hidden.dim() < 1 or hidden.shape[-1] < 1:
        raise ValueError(f"hidden: must be [..., H] with H >= 1, got {tuple(hidden.shape)}")
    tp_world_size, tp_rank = _tp_layout(tp_group)
    _check_labels_shape(hidden, labels, tp_hidden, tp_world_size)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: must be [V_local, H] with H={hidden.shape[-1]} matching hidden, got {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError("weight: the vocabulary shard must hold at least one column")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"hidden/weight: must be floating point, got {hidden.dtype} and {weight.dtype}")
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(
            f"hidden, weight, labels: must share one device, got {hidden.device}, {weight.device}, {labels.device}"
        )
    if not _is_integer_dtype(labels.dtype):
        raise ValueError(f"labels: must be an integer tensor, got {labels.dtype}")
    check_bool("return_label_is_max", return_label_is_max)
    check_int("tile_rows", tile_rows, low=1, optional=True, expected="must be an int >= 1 or None")
    check_int("keep_logits_bytes", keep_logits_bytes, low=0, expected="must be an int >= 0 (0: recompute every row)")
    check_bool("gradient_accumulation_fusion", gradient_accumulation_fusion)
    check_bool("batch_invariant", batch_invariant)
    # no gradient (a frozen weight, or a no-grad forward such as a reference model's, maybe never DDP-wrapped): no
    # main_grad to check
    wants_main_grad = gradient_accumulation_fusion and weight.requires_grad and torch.is_grad_enabled()
    main_grad_dtype = check_main_grad(weight) if wants_main_grad else None

    local_vocab = weight.shape[0]
    padded_vocab = local_vocab * tp_world_size
    if vocab_size is None:
        vocab_size = padded_vocab
    check_int(
        "vocab_size",
        vocab_size,
        low=1,
        high=padded_vocab,
        expected=f"must be an int in [1, {padded_vocab}] (V_local * tp size)",
    )

    flat_labels = labels.reshape(-1).long()
    if score_mask is not None and (score_mask.shape != labels.shape or score_mask.dtype != torch.bool):
        raise ValueError(
            f"score_mask: must be a bool tensor shaped like labels {tuple(labels.shape)}, got {score_mask.dtype} "
            f"{tuple(score_mask.shape)}"
        )
    row_temperature = _check_temperature(temperature, labels, hidden.device)
    label_check = None
    if defer_label_check and flat_labels.numel():
        label_check = PendingLabelCheck(flat_labels, row_temperature, ignore_index, vocab_size)
        scored = None  # a row whose label is ignore_index is computed, then zeroed by the caller after finish()
    else:
        scored = _labelled_rows(flat_labels, row_temperature, ignore_index, vocab_size)  # None: every row scored
    mask_rows = None
    if score_mask is not None:
        if scored is None and score_mask.device.type == "cpu":
            # the rows found on the host: no wait for the GPU (an asynchronous copy from pageable memory waits for
            # nothing queued before it)
            mask_rows = score_mask.reshape(-1).nonzero().squeeze(1).to(flat_labels.device, non_blocking=True)
        else:
            mask = score_mask.reshape(-1).to(flat_labels.device)
            scored = mask if scored is None else scored & mask

    if tp_world_size > 1 and not row_counts_checked(tp_group):  # the collectives come after every check
        if mask_rows is not None:
            scored_rows = mask_rows.numel()
        else:
            scored_rows = flat_labels.numel() if scored is None else int(scored.sum())
        check_row_counts_agree(tp_group, hidden.device, flat_labels.numel(), scored_rows)

    if mask_rows is not None:
        active_rows = mask_rows
    elif scored is None:  # every row scored: no nonzero(), which would wait for the GPU again
        active_rows = torch.arange(flat_labels.numel(), device=flat_labels.device)
    else:
        active_rows = scored.nonzero().squeeze(1)
    vocab_start = tp_rank * local_vocab
    hidden = full_hidden(hidden, tp_hidden, tp_group, tp_world_size)
    problem = LogProbProblem(
        hidden=hidden.reshape(-1, hidden.shape[-1]),
        weight=weight,
        labels=flat_labels,
        temperature=row_temperature,
        active_rows=active_rows,
        vocab_start=vocab_start,
        valid_columns=max(0, min(local_vocab, vocab_size - vocab_start)),
        tp_group=tp_group if tp_world_size > 1 else None,
        tp_world_size=tp_world_size,
        calculate_entropy=calculate_entropy,
        tile_rows=tile_rows if tile_rows is not None else default_tile_rows(local_vocab),
        label_is_max=torch.zeros(flat_labels.shape, dtype=torch.bool, device=hidden.device)
        if return_label_is_max
        else None,
        vocab_size=vocab_size,
        keep_logits_bytes=keep_logits_bytes,
        main_grad_dtype=main_grad_dtype,
        batch_invariant=batch_invariant,
        label_check=label_check,
    )
    return problem


def _label_extremes(flat_labels: torch.Tensor, row_temperature) -> torch.Tensor:
    """int64 [2] or [3] on the labels' device, not read here: the labels' min and max (and 1 where some per-row
    temperature is not finite and > 0). Every launch here is host time the GPU waits for before the op's kernel
    (~15 us each), so the common case (every label in range, none ignored) costs one reduction and one read."""
    values = [*torch.aminmax(flat_labels)]
    if isinstance(row_temperature, torch.Tensor):
        values.append(bad_temperatures(row_temperature).long())
    return torch.stack(values)


def _labelled_from_extremes(
    extremes: list[int], flat_labels: torch.Tensor, ignore_index: int, vocab_size: int
) -> torch.Tensor | None:
    """bool [N]: the rows whose label is not ignore_index, None when that is every row; a ValueError for a label
    neither in [0, vocab_size) nor ignore_index, or a per-row temperature that is not finite and > 0. `extremes`:
    `_label_extremes`' values, read; a label outside [0, vocab_size) (ignored rows, say) costs a second read that
    tells the two apart."""
    low, high, *flags = extremes
    if any(flags):
        raise ValueError("temperature: every value must be finite and > 0")
    if 0 <= low and high < vocab_size and not low <= ignore_index <= high:
        return None
    labelled = flat_labels != ignore_index
    out_of_range = labelled & ((flat_labels < 0) | (flat_labels >= vocab_size))
    labels_bad, some_ignored = torch.stack([out_of_range.any(), (~labelled).any()]).tolist()
    if labels_bad:
        bad = flat_labels[out_of_range][0].item()
        raise ValueError(f"labels: ids must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}, found {bad}")
    return labelled if some_ignored else None


def _labelled_rows(
    flat_labels: torch.Tensor, row_temperature, ignore_index: int, vocab_size: int
) -> torch.Tensor | None:
    """`_labelled_from_extremes` of the labels, read now (on CUDA one wait for the GPU)."""
    if flat_labels.numel() == 0:  # no min or max: the extremes of no label out of range
        flags = [int(bad_temperatures(row_temperature))] if isinstance(row_temperature, torch.Tensor) else []
        extremes = [0, 0, *flags]
    else:
        extremes = _label_extremes(flat_labels, row_temperature).tolist()
    return _labelled_from_extremes(extremes, flat_labels, ignore_index, vocab_size)


class PendingLabelCheck:
    """`_labelled_rows`' check, started before the op's kernels and read after them, so that at small N the GPU
    does not wait for the host between the read and the kernel's launch. On CUDA the extremes travel to pinned
    host memory by an asynchronous copy queued before the kernels: `finish()` waits for that copy alone."""

    def __init__(self, flat_labels: torch.Tensor, row_temperature, ignore_index: int, vocab_size: int):
        self._labels, self._ignore_index, self._vocab_size = flat_labels, ignore_index, vocab_size
        extremes = _label_extremes(flat_labels, row_temperature)
        self._ready = None
        if extremes.is_cuda:
            self._extremes = torch.empty(extremes.shape, dtype=extremes.dtype, pin_memory=True)
            self._extremes.copy_(extremes, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._extremes = extremes

    def finish(self) -> torch.Tensor | None:
        """bool [N]: the rows whose label is not ignore_index (the caller zeroes the others' outputs), None when
        that is every row; the ValueError of a label out of range or a bad temperature."""
        if self._ready is not None:
            self._ready.synchronize()
        return _labelled_from_extremes(self._extremes.tolist(), self._labels, self._ignore_index, self._vocab_size)


def _check_labels_shape(hidden: torch.Tensor, labels: torch.Tensor, tp_hidden: str, tp_world_size: int) -> None:
    """labels (and what is shaped like them) cover every row: under "sequence_sharded" hidden's dim 0 is
    this rank's slice, so labels' dim 0 is tp size times it."""
    if tp_hidden == "sequence_sharded" and tp_world_size > 1:
        if hidden.dim() < 2:
            raise ValueError(f"hidden: tp_hidden='sequence_sharded' needs [s / tp, ..., H], got {tuple(hidden.shape)}")
        rows = (hidden.shape[0] * tp_world_size, *hidden.shape[1:-1])
        if labels.shape != rows:
            raise ValueError(
                f"labels: must be shaped like hidden without its last dim, hidden's dim 0 gathered over the "
                f"{tp_world_size} "
                f"ranks of tp_group (tp_hidden='sequence_sharded'): {rows}, got {tuple(labels.shape)}"
            )
        return
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels: must be shaped like hidden without its last dim {tuple(hidden.shape[:-1])}, got "
            f"{tuple(labels.shape)}"
        )
