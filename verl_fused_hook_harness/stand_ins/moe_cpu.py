"""Run megatron-core's MoE layer on the CPU over gloo (tests and CPU runs only).

STAND-INS, named as such, for megatron-core 0.19.2's all-to-all token
dispatcher (the one verl configures, `moe_token_dispatcher_type="alltoall"`):
- it creates a CUDA stream for its device-to-host copies while the layer is
  constructed (`MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()`),
  which fails without a CUDA driver, and records an event on it every step. On
  the CPU every op already runs in order: a stream whose waits and events are
  no-ops stands in;
- its split sizes reach `all_to_all_single` as numpy arrays on GPUs
  (`maybe_move_tensor_to_cpu(..., as_numpy=True)` copies CUDA tensors to the
  host); that function leaves CPU tensors as tensors, which the all-to-all
  refuses as split sizes under `cuda_names_on_cpu`'s function mode, so the
  dispatcher's copy of it converts CPU tensors the same way;
- with expert tensor parallelism (ETP > 1; megatron's default ETP is TP) it
  gathers and reduce-scatters tokens over the expert TP group in uneven splits
  (`_gather_along_first_dim` / `_reduce_scatter_along_first_dim` with split
  sizes), which NCCL does and gloo refuses ("invalid tensor size"). On gloo
  they become an even all-gather of zero-padded splits and an all-reduce of the
  whole tensor, each rank keeping its split: the same values.
- every step it compares `torch.cuda.current_stream()` with that stream and runs
  its copies under `torch.cuda.stream(...)`: on a machine without CUDA both are
  given CPU answers (the stream above, a no-op context), process-wide, as
  megatron_cpu.py answers `torch.cuda.current_device()` with "cpu".
The router moves its weights to `torch.cuda.current_device()`, already "cpu".
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class CpuEvent:
    """An event on the CPU: everything before it has already happened."""

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuDtohStream:
    """The dispatcher's device-to-host stream on the CPU."""

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None) -> CpuEvent:
        return CpuEvent()


_CPU_STREAM = CpuDtohStream()


def _current_cpu_stream(device=None) -> CpuDtohStream:
    return _CPU_STREAM


def _no_stream(stream=None):
    return contextlib.nullcontext()


def _host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron's `maybe_move_tensor_to_cpu` for CPU tensors: numpy when asked, as it returns for CUDA ones."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _uneven_on_gloo(group, split_sizes) -> bool:
    return split_sizes is not None and group.size() > 1 and dist.get_backend(group) == "gloo"


def _gather_uneven_on_gloo(original):
    def gather(input_, group, output_split_sizes=None, use_global_buffer=False):
        if not _uneven_on_gloo(group, output_split_sizes):
            return original(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        gathered = input_.new_empty((longest * group.size(), *input_.shape[1:]))
        dist.all_gather_into_tensor(gathered, padded, group=group)
        return torch.cat([part[:size] for part, size in zip(gathered.split(longest), output_split_sizes)])

    return gather


def _reduce_scatter_uneven_on_gloo(original):
    def reduce_scatter(input_, group, input_split_sizes=None, use_global_buffer=False):
        if not _uneven_on_gloo(group, input_split_sizes):
            return original(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.split(list(input_split_sizes))[group.rank()].contiguous()

    return reduce_scatter


def enable_cpu_moe() -> None:
    """Install the stand-ins above (process-wide, idempotent; nothing changes where CUDA is available)."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import token_dispatcher

    if token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = CpuDtohStream()
    torch.cuda.current_stream = _current_cpu_stream
    torch.cuda.stream = _no_stream
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    if not getattr(mappings, "_verl_fused_hook_uneven_on_gloo", False):
        mappings._gather_along_first_dim = _gather_uneven_on_gloo(mappings._gather_along_first_dim)
        mappings._reduce_scatter_along_first_dim = _reduce_scatter_uneven_on_gloo(
            mappings._reduce_scatter_along_first_dim
        )
        mappings._verl_fused_hook_uneven_on_gloo = True
