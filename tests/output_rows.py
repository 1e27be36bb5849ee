"""Counting the rows the output weight multiplies, for tests that rows nobody reads are never computed."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OutputWeightRows(TorchDispatchMode):
    """Counts hidden rows multiplied by the output weight (matmuls whose right operand is [H, V_local]). Rows of
    zeros are not counted: the portable backend pads its statistics blocks with them to whole multiples of
    `torch_backend.STATISTICS_ROW_MULTIPLE` rows (batch invariance), and no hidden state of a model is all zeros."""

    def __init__(self, hidden_size: int, vocab_local: int):
        super().__init__()
        self.shape = (hidden_size, vocab_local)
        self.rows = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            left, right = (args[0], args[1]) if func is torch.ops.aten.mm.default else (args[1], args[2])
            if tuple(right.shape) == self.shape:
                self.rows += int(left.ne(0).any(dim=1).sum())
        return func(*args, **(kwargs or {}))
