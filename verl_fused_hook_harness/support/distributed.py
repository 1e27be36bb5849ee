"""Run a function in N gloo processes on the CPU and hand each rank's result back to the caller.

Used by the tensor-parallel tests and the A/B script: workers return plain
Python/tensor objects, which travel back through files in a temporary folder,
so the parent process can assert on them with ordinary error messages.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, folder: str, fn: Callable, args: tuple, env: dict) -> None:
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, os.path.join(folder, f"rank{rank}.pt"))
    except BaseException:  # report the worker's traceback to the parent
        torch.save({"ok": False, "error": traceback.format_exc()}, os.path.join(folder, f"rank{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_on_gloo(fn: Callable, world_size: int, *args: Any, env: dict | None = None) -> list[Any]:
    """Run fn(rank, world_size, *args) in `world_size` spawned processes; return their results by rank.

    fn must be importable at module level (spawn pickles it by name). A failing
    rank's traceback is raised in the parent as RuntimeError.
    """
    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(
            _worker,
            args=(world_size, free_port(), folder, fn, args, dict(env or {})),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        try:
            while not context.join():
                pass
        except mp.ProcessRaisedException:
            pass  # the rank's own traceback is in its result file
        results = []
        for rank in range(world_size):
            path = os.path.join(folder, f"rank{rank}.pt")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} of {world_size} died without a result")
            outcome = torch.load(path, weights_only=False)
            if not outcome["ok"]:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{outcome['error']}")
            results.append(outcome["result"])
        return results
