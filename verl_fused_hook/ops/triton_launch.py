"""What the Triton backend's launches need from the host: a tile configuration's fields, TMA-ready tensors
and their descriptors, and the SM count that sizes persistent grids. Shared by the forward
(triton_backend.py) and the recomputing backward (triton_recompute.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    """Block shape and pipelining of one kernel launch; ctas_per_sm feeds the wave arithmetic."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    ctas_per_sm: int


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """Row-major with a 16-byte aligned base, as TMA descriptors require (copies only if not)."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    return out.copy_(t)


def descriptor(t: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
