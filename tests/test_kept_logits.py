"""The kept-logits buffer of the two-pass op (ops/backends/triton_backend.py) on the CPU: how many rows a budget
keeps, and what happens when the allocator refuses. The refusal is a named fake (torch.empty raising the CUDA
allocator's torch.OutOfMemoryError, which a CPU allocation does not raise); the kernels that fill the buffer are
tested in tests/test_triton_interpreter.py (CPU) and tests/gpu/test_triton_backend.py."""

from __future__ import annotations

import logging

import pytest
import torch

from verl_fused_hook import log_once
from verl_fused_hook.ops.backends import triton_backend

COLUMNS, TILE = 301, 32  # a row: fp16 logits at a pitch of 304, an fp32 max for each of 10 column tiles
ROW_BYTES = 2 * 304 + 4 * 10


@pytest.mark.parametrize(
    "budget, rows, kept",
    [
        (10**9, 70, 70),  # every row fits: every row, not rounded to blocks
        (70 * ROW_BYTES, 70, 70),  # exactly
        (69 * ROW_BYTES, 70, 64),  # not every row: whole 16-row blocks
        (40 * ROW_BYTES, 70, 32),
        (15 * ROW_BYTES, 70, 0),  # less than a block: nothing kept
        (ROW_BYTES - 1, 1, 0),
    ],
)
def test_a_budget_keeps_every_row_or_whole_row_blocks(budget, rows, kept):
    store = triton_backend.kept_rows_buffer(budget, rows, COLUMNS, 16, TILE, torch.device("cpu"))
    if kept == 0:
        assert store is None
        return
    assert store.shifted.shape == (kept, COLUMNS) and store.shifted.stride(0) == 304
    assert store.shifted.dtype == torch.float16
    assert store.tile_max.shape == (kept, 10) and store.tile_max.dtype == torch.float32
    assert store.tile_columns == TILE


def test_a_refused_allocation_recomputes_and_warns_once(monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    monkeypatch.setattr(log_once, "_said", set())  # nothing said yet
    monkeypatch.setattr(triton_backend.torch, "empty", refuse)
    with caplog.at_level(logging.DEBUG, logger=triton_backend.__name__):
        for _ in range(2):
            assert triton_backend.kept_rows_buffer(10**9, 70, COLUMNS, 16, TILE, torch.device("cpu")) is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            level,
            "log_probs_and_entropy: keep_logits_bytes: 70 rows of kept logits could not be allocated (CUDA out of "
            "memory. Tried to allocate 4.00 GiB); this call recomputes every row's logits in its backward",
        )
        for level in (logging.WARNING, logging.DEBUG)
    ]
