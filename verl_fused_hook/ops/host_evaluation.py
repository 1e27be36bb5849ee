"""Where the loss-inside op's final loss evaluation runs on CUDA, so it overlaps the last chunk's GEMMs.

Why: the final evaluation (loss value, metrics, separability check) is mostly host work with
synchronizations (verl's ppo_loss has dozens). With `host_loss_fn` it runs on pinned host
copies of the final values, taken in stream order right after the last chunk's statistics and
ahead of its gradient GEMMs: nothing it does waits for the GPU. Otherwise loss_fn runs on a
high-priority CUDA stream that waits only for the last chunk's statistics.

The host evaluation runs on one intra-op thread: its tensors hold one value per token, where a
team of OpenMP threads gains nothing and, when one of its threads is descheduled, stalls a whole
step (H200 host, 16 threads, 65536 rows: about one step in five 70-90 ms slower; none with one).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .separability import LossCall, check_separable, evaluate


class HostCopy:
    """Host copies of the final values, enqueued on the current stream: pinned buffers the copy engine fills
    while the GEMMs queued after them run; `values()` waits for that copy only. Off CUDA the tensors are
    already on the host."""

    def __init__(self, *tensors: torch.Tensor | None):
        self.event = None
        if tensors[0].device.type != "cuda":
            self.copies = tensors
            return
        self.copies = tuple(
            None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in tensors
        )
        self.sources = tensors  # kept alive (and unreused by the allocator) until the copy is done
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(tensors[0].device))  # the stream the copies were queued on

    def values(self) -> tuple[torch.Tensor | None, ...]:
        if self.event is not None:
            self.event.synchronize()
            self.sources = None
        return self.copies


def evaluate_on_host(call: LossCall, copy: HostCopy, device: torch.device):
    """host_loss_fn's final evaluation and the separability check, on the host copies; the loss back on `device`."""
    log_probs, entropy, g_lp_used, g_ent_used, active_rows = copy.values()
    with one_intra_op_thread():
        loss, metrics, g_lp_exact, g_ent_exact = evaluate(call, log_probs, entropy, True, loss_fn=call.host_loss_fn)
        check_separable(call, g_lp_used, g_lp_exact, active_rows, "log-prob")
        if g_ent_used is not None:
            check_separable(call, g_ent_used, g_ent_exact, active_rows, "entropy")
    if device.type == "cuda":
        return loss.pin_memory().to(device, non_blocking=True), metrics
    return loss, metrics


@contextlib.contextmanager
def one_intra_op_thread():
    """torch's intra-op threads set to one inside, restored after (also when the loss raises). The setting is the
    process's: CPU ops of other threads in it run single-threaded for those milliseconds too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def evaluation_stream(device: torch.device) -> torch.cuda.Stream:
    """One high-priority stream per device for loss_fn's final evaluation (its kernels go first when SMs free up).
    Reused by every call: each use first waits for the main stream, so blocks it frees are safe to reuse."""
    return torch.cuda.Stream(device, priority=-100)
