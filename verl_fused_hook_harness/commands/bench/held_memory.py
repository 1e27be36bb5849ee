"""The bench on a GPU short of memory (`bench --leave-free-gib G`): what holds the rest, and what the fused loss
planned under it.

Why: a job that fits with the two-pass op must never run out of memory because the fused loss is on; the bench
shows it by holding all but G GiB while it measures and recording the chunk plans the loss-inside op logged.
"""

from __future__ import annotations

import logging

import torch

from verl_fused_hook.ops.chunking import available_bytes

GIB = 1024**3


def hold_memory(leave_free_gib: float | None) -> torch.Tensor | None:
    """An allocation of everything the methods could allocate on the GPU but `leave_free_gib` GiB (None: nothing
    held), taken once a shape's inputs exist: the G GiB are the methods' own room beside their inputs."""
    if leave_free_gib is None:
        return None
    torch.cuda.empty_cache()
    free = available_bytes(torch.device("cuda"))
    hold = max(0, free - int(leave_free_gib * GIB))
    print(f"# holding {hold / GIB:.1f} GiB of {free / GIB:.1f} GiB free; {leave_free_gib:g} GiB left", flush=True)
    return torch.empty(hold, dtype=torch.uint8, device="cuda")


class ChunkPlans(logging.Handler):
    """The loss-inside op's chunk plans (verl_fused_hook.ops.chunking's debug lines and fallback warnings), kept
    while another allocation holds memory: the record that the chunk shrank to what was free."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.logger = logging.getLogger("verl_fused_hook.ops.chunking")

    def __enter__(self):
        self.level = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if line not in self.lines:
            self.lines.append(line)

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines
