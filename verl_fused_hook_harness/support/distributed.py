"""The harness's one process launcher: a function in N processes (gloo on the CPU, NCCL on GPUs), each rank's
result handed back to the caller.

Why one launcher: the tests, `ab-parity` and `train-parity` all start worker processes. Workers return plain
Python/tensor objects, which travel back through files in a temporary folder, so the parent reports a failing
rank with that rank's own traceback. `init_single_process` is the one-process counterpart the e2e benchmarks use.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .determinism import prepare_cublas_workspace
from .upstream_notices import unprinted_gloo_connections

logger = logging.getLogger(__name__)


def _rendezvous_store(world_size: int) -> dist.TCPStore:
    """The group's rendezvous, listening on a port the kernel picks and the store keeps: no gap between choosing a
    free port and binding it, in which another process could take it."""
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)


def init_one_rank_group(backend: str) -> None:
    """This process as a one-rank default group (NCCL on GPU 0, or gloo)."""
    if backend == "nccl":
        torch.cuda.set_device(0)
    with unprinted_gloo_connections():
        dist.init_process_group(backend, store=_rendezvous_store(1), rank=0, world_size=1)


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


def _worker(rank: int, world_size: int, port: int, folder: str, backend: str, fn: Callable, args: tuple, env: dict):
    os.environ.update(env)
    # the variables too, for code that reads them; the group itself rendezvouses at the parent's store on `port`
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if backend == "nccl":
        os.environ["LOCAL_RANK"] = str(rank)
        prepare_cublas_workspace()  # before the first GEMM: deterministic parity steps need it
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    with unprinted_gloo_connections():
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    path = os.path.join(folder, f"rank{rank}.pt")
    try:
        try:
            result = fn(rank, world_size, *args)
        except BaseException:  # report the worker's traceback to the parent
            torch.save({"ok": False, "error": traceback.format_exc()}, path)
            raise
        torch.save({"ok": True, "result": result}, path)
        # every rank done before any tears its group down: a rank that exits while a peer's gloo threads still
        # talk to it aborts ("terminate called without an active exception"), seen with 4 ranks on 2 cores
        try:
            dist.barrier()
        except RuntimeError as error:  # a peer gone: the parent judges by every rank's file, this result stands
            print(f"rank {rank}: the barrier after its result failed ({error})", file=sys.stderr, flush=True)
    finally:
        dist.destroy_process_group()


def run_in_processes(fn: Callable, world_size: int, *args: Any, backend: str = "gloo", env: dict | None = None) -> list:
    """fn(rank, world_size, *args) in `world_size` spawned processes on `backend` (NCCL: one GPU per rank);
    their results by rank.

    fn must be importable at module level (spawn pickles it by name). A failing rank's traceback is raised in
    the parent as RuntimeError."""
    store = _rendezvous_store(world_size)  # held until the ranks are done
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(
            _worker,
            args=(world_size, store.port, folder, backend, fn, args, dict(env or {})),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        exit_error = None
        try:
            while not context.join():
                pass
        except mp.ProcessRaisedException:
            pass  # the rank's own traceback is in its result file
        except mp.ProcessExitedException as error:  # killed by a signal: judged by the result files below
            exit_error = error
        outcomes = []
        for rank in range(world_size):
            path = os.path.join(folder, f"rank{rank}.pt")
            outcomes.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        # the root cause first: a rank killed by a signal before its result (its peers' errors follow from it: a
        # collective or the barrier with a rank gone), then a rank's own error (the ranks the launcher stopped after
        # it leave no result)
        if exit_error is not None and outcomes[exit_error.error_index] is None:
            raise RuntimeError(f"rank {exit_error.error_index} of {world_size} died without a result ({exit_error})")
        for rank, outcome in enumerate(outcomes):
            if outcome is not None and not outcome["ok"]:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{outcome['error']}")
        for rank, outcome in enumerate(outcomes):
            if outcome is None:
                cause = f" ({exit_error})" if exit_error is not None else ""
                raise RuntimeError(f"rank {rank} of {world_size} died without a result{cause}")
        if exit_error is not None:
            # every rank wrote its result before the barrier that precedes teardown, so the signal came after it:
            # gloo's threads aborting at exit under load ("terminate called without an active exception")
            logger.warning("all %d ranks wrote their results, then %s; the results stand", world_size, exit_error)
        return [outcome["result"] for outcome in outcomes]


def init_single_process(device: str, seed: int) -> None:
    """This process as a one-rank group (NCCL on CUDA, else gloo) with megatron's parallel state at TP=1."""
    from ..stand_ins.megatron_cpu import init_model_parallel  # imports megatron-core: only where a model is built

    if device == "cuda" and not dist.is_initialized():
        init_one_rank_group("nccl")
    init_model_parallel(1, seed=seed)
