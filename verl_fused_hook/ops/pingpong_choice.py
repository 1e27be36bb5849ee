"""Which kernel writes d_logits in the Triton backend's backward on this GPU: the Gluon ping-pong kernel
(gluon_kernels.py) where it was written and tested, else Triton's (triton_kernels.grad_logits_kernel).

Why a module of its own: importing gluon_kernels imports Gluon's Hopper API, which older Tritons lack,
so the choice has to be made before that import, once per device, with one log line when it says no.
"""

from __future__ import annotations

import functools
import logging

import torch

logger = logging.getLogger(__name__)

# Gluon's warp_specialize and Hopper TMA/wgmma API in the form gluon_kernels uses (checked on 3.6 and 3.8).
MIN_TRITON = (3, 6)


def pingpong_kernels(device: torch.device):
    """gluon_kernels on a Hopper GPU with Triton >= MIN_TRITON, else None. Tensors off CUDA (Triton's
    interpreter in the CPU tests) get None without a log line: there is no GPU path to fall back from."""
    if device.type != "cuda":
        return None
    return _for_cuda_device(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _for_cuda_device(index: int):
    import triton

    capability = torch.cuda.get_device_capability(index)
    version = tuple(int(part) for part in triton.__version__.split(".")[:2] if part.isdigit())
    if capability != (9, 0):
        reason = f"compute capability {capability[0]}.{capability[1]} (it uses Hopper's wgmma)"
    elif version < MIN_TRITON:
        reason = f"Triton {triton.__version__} (it needs Triton >= {MIN_TRITON[0]}.{MIN_TRITON[1]}'s Gluon API)"
    else:
        try:
            from . import gluon_kernels
        except ImportError as error:
            reason = f"Gluon cannot be imported ({error})"
        else:
            return gluon_kernels
    logger.info("triton backend on cuda:%d: the backward's d_logits run Triton's kernel, not the Gluon ping-pong "
                "kernel: %s", index, reason)
    return None
