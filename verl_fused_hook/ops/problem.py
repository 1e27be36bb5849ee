"""The normalized problem every backend receives.

`log_probs_and_entropy` validates the user's arguments once and hands backends
this flat, checked description, so a backend only does arithmetic.
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

    hidden: [N, H]; weight: [V_local, H]; labels: [N] global ids (only rows in
    `active_rows` are read); temperature: a float or an fp32 [N] tensor;
    active_rows: int64 indices of the rows to compute (sorted, unique);
    vocab_start: first global id held by this rank; valid_columns: how many of
    this rank's columns are real vocabulary (the rest is Megatron's padding);
    label_is_max: None, or a bool [N] buffer (all False) that the statistics
    merge fills at the scored rows with "the label's logit is the row maximum",
    so acceptance needs no logits and no backend change.
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

    @property
    def num_rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and (self.hidden.requires_grad or self.weight.requires_grad)


def default_tile_rows(local_vocab: int) -> int:
    """Rows per tile so that one fp32 [rows, V_local] logits tile is ~TILE_BUDGET_BYTES."""
    return max(1, TILE_BUDGET_BYTES // (4 * max(1, local_vocab)))
