"""Which kernel computes the Triton backend's forward partials on this GPU: the warp-specialized Gluon kernel
(gluon_forward.py) where it was written and tested (Hopper, Triton >= 3.6), else Triton's forward_statistics_kernel.

Why a module of its own: importing gluon_forward imports Gluon's Hopper API, which older Tritons lack, so the choice
is made before that import, once per device, with one log line when it says no.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

# Gluon's warp_specialize and Hopper TMA/wgmma API in the form gluon_forward uses (checked on 3.6 and 3.8).
MIN_TRITON = (3, 6)


def gluon_forward_kernel(device: torch.device):
    """The gluon_forward module on a Hopper GPU with Triton >= MIN_TRITON, else None (and one log line saying why).
    Tensors off CUDA (Triton's interpreter in the CPU tests) get None silently: there is no GPU path to leave."""
    if device.type != "cuda":
        return None
    return _for_cuda_device(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def why_not_gluon(index: int) -> str | None:
    """None where the Gluon forward runs on cuda:`index`, else why not (`doctor` shows it)."""
    import triton

    capability = torch.cuda.get_device_capability(index)
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if capability != (9, 0):
        return f"compute capability {capability[0]}.{capability[1]} (it is written for Hopper's wgmma)"
    if version < MIN_TRITON:
        return f"Triton {triton.__version__} (it needs Triton >= {MIN_TRITON[0]}.{MIN_TRITON[1]}'s Gluon API)"
    try:
        from . import gluon_forward  # noqa: F401
    except ImportError as error:
        return f"Gluon cannot be imported ({error})"
    return None


@functools.cache
def _for_cuda_device(index: int):
    reason = why_not_gluon(index)
    if reason is None:
        from . import gluon_forward

        return gluon_forward
    logger.info(
        "triton backend on cuda:%d: the forward's partials run Triton's kernel, not the warp-specialized Gluon "
        "kernel: %s",
        index,
        reason,
    )
    return None
