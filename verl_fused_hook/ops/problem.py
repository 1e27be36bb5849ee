"""The normalized problem every backend receives, and the block of rows its primitives work on.

`build_problem` (interface.py) validates the user's arguments once and hands the
drivers this flat, checked description, so a backend only does arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

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
    dtype of `weight.main_grad`, which the two-pass op's backward adds d_weight into (main_grad.py).
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


@dataclass(frozen=True)
class RowBlock:
    """One block of scored rows, prepared by a backend for its primitives.

    span: where the block sits among the scored rows (slices the per-row statistics and gradients);
    rows: int64 indices of its rows in the problem; hidden: those rows in the form the backend
    multiplies; label_col: the label's column in this shard, -1 where another rank holds it;
    inv_temp: fp32 1 / temperature per row.
    """

    span: slice
    rows: torch.Tensor
    hidden: torch.Tensor
    label_col: torch.Tensor
    inv_temp: torch.Tensor


def default_tile_rows(local_vocab: int) -> int:
    """Rows per tile so that one fp32 [rows, V_local] logits tile is ~TILE_BUDGET_BYTES."""
    return max(1, TILE_BUDGET_BYTES // (4 * max(1, local_vocab)))
