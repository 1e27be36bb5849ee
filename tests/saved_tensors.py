"""Test-only probe: the bytes autograd saves for backward (the op's memory contract in tests/test_op.py)."""

from __future__ import annotations

import torch


class SavedTensorBytes:
    """Bytes autograd saves for backward, excluding the listed input tensors."""

    def __init__(self, *inputs: torch.Tensor):
        self._inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor):
        if tensor.untyped_storage().data_ptr() not in self._inputs:
            self.bytes += tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)
