"""Run verl's Megatron engine set-up and megatron-core's optimizers on the CPU (CPU tests and CPU train-parity only).

FAKES, named as such. On a machine without CUDA verl falls back to its CUDA
platform (`get_device_name()` is "cuda", `get_torch_device()` is `torch.cuda`;
`torch.cuda.current_device` already answers "cpu", see megatron_cpu.py), and:
- megatron-core's optimizer code (DistributedOptimizer, Float16/FP32
  optimizers, grad clipping) creates its scalars with `device='cuda'`, moves
  states with `.cuda()` and accepts parameters only when `param.type()` names a
  CUDA tensor type ('torch.cuda.FloatTensor', ...); its arithmetic is plain
  PyTorch. A TorchFunctionMode sends every `device='cuda'` to the CPU, makes
  `.cuda()` a no-op and lets `.type()` report a CPU tensor under its CUDA name.
- verl's offload allocates pinned host buffers (`pin_memory=True` needs a
  CUDA driver): unpinned here; on the CPU offload moves between CPU tensors.
- verl logs device memory after init and offload (`torch.cuda.memory_allocated`,
  `memory_reserved`, `mem_get_info`): those report 0 here; megatron's DDP
  synchronises and orders streams (`current_stream`, `stream`, `synchronize`):
  no-ops here, where every op runs in order.
The model's forward and backward, the DDP buffers, the loss and the optimizer's
arithmetic run unchanged on CPU tensors. Everything is restored on exit; with
CUDA present nothing is changed.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


class _CpuStream:
    """A stream on the CPU: work is already ordered, so waiting is a no-op."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


_CUDA_FAKES = {
    "memory_allocated": lambda *a, **k: 0,
    "memory_reserved": lambda *a, **k: 0,
    "max_memory_allocated": lambda *a, **k: 0,
    "mem_get_info": lambda *a, **k: (0, 0),
    "current_stream": lambda *a, **k: _CpuStream(),
    "stream": lambda *a, **k: contextlib.nullcontext(),
    "synchronize": lambda *a, **k: None,
}


def _is_cuda_device(device) -> bool:
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaNamesOnCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_names_on_cpu():
    """Within the block verl's engine set-up and megatron-core's CUDA-only optimizer code run on CPU tensors."""
    if torch.cuda.is_available():
        yield
        return
    saved = {name: getattr(torch.cuda, name) for name in _CUDA_FAKES}
    for name, fake in _CUDA_FAKES.items():
        setattr(torch.cuda, name, fake)
    try:
        with _CudaNamesOnCpu():
            yield
    finally:
        for name, original in saved.items():
            setattr(torch.cuda, name, original)
