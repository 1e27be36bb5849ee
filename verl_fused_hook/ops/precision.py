"""The op computes in fp32 whatever autocast the caller runs under, in its backward too.

Why: autocast would turn the tile GEMMs into bf16 ones. The interface
disables autocast around the forward; a backward runs with the autocast
state of the thread that calls `.backward()` (on the CPU, the caller's own),
so each backward disables it as well.
"""

from __future__ import annotations

import functools

import torch


def fp32_backward(backward):
    """Run an autograd Function's backward with autocast off on every device type."""

    @functools.wraps(backward)
    def without_autocast(ctx, *grads):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return backward(ctx, *grads)

    return without_autocast
