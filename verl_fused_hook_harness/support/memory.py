"""Peak bytes of tensors allocated inside a block, measured on the CPU with a dispatch mode.

Every op's output storage is counted once (views share it) and released when
the last tensor referring to it is garbage collected, so the peak is the
largest set of tensors the code under test kept alive at one time.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakMemory(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0
        self._refs: dict[int, int] = {}

    def _release(self, pointer: int, nbytes: int) -> None:
        self._refs[pointer] -= 1
        if self._refs[pointer] == 0:
            del self._refs[pointer]
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if type(tensor) is not torch.Tensor or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            pointer, nbytes = storage.data_ptr(), storage.nbytes()
            if pointer == 0:
                continue
            if pointer not in self._refs:
                self._refs[pointer] = 0
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                self.largest = max(self.largest, nbytes)
            self._refs[pointer] += 1
            weakref.finalize(tensor, self._release, pointer, nbytes)
        return out
