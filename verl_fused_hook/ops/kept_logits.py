"""Logits the Triton forward kernel keeps for a gradient pass: their layout, and the buffer for as many rows as
a budget holds.

Why a module of its own: both ops keep logits the same way (the fused loss per chunk of rows, the two-pass op
for the rows `keep_logits_bytes` holds), and a kept buffer the GPU cannot give must not stop a training step:
the two-pass op then recomputes every row of that call, and a warning says so once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)
_warned: list[bool] = []  # a refusal was logged at warning level; later ones go to debug


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


def kept_rows_buffer(budget: int, rows: int, columns: int, row_block: int, tile_columns: int,
                     device: torch.device) -> StoredLogits | None:
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
        level = logging.DEBUG if _warned else logging.WARNING
        _warned[:] = [True]
        logger.log(level, "log_probs_and_entropy: keep_logits_bytes: %d rows of kept logits could not be allocated "
                   "(%s); this call recomputes every row's logits in its backward", kept, reason)
        return None
