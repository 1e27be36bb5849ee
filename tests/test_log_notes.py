"""The plugin's notes on a job of several ranks: INFO once on rank 0, DEBUG on the others; warnings everywhere.

Two real gloo processes on the CPU (the plugin reads the global rank from torch.distributed).
"""

from __future__ import annotations

import logging


def _log_on_rank(rank, world_size):
    from verl_fused_hook.log_once import log_once, note

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    logger = logging.getLogger("verl_fused_hook.test_notes")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Keep())
    for _ in range(3):  # a step's notes repeat every step
        log_once(logger, "loss X is not separable; two-pass path")
    log_once(logger, "this rank's own trouble", logging.WARNING)
    note(logger, "plan of %s", "McoreEngine")
    return records


def test_notes_are_said_on_rank_zero_and_kept_at_debug_elsewhere():
    from verl_fused_hook_harness.support.distributed import run_in_processes

    rank0, rank1 = run_in_processes(_log_on_rank, 2)
    assert rank0 == [
        ("INFO", "loss X is not separable; two-pass path"),
        ("WARNING", "this rank's own trouble"),
        ("INFO", "plan of McoreEngine"),
    ]
    assert rank1 == [
        ("DEBUG", "loss X is not separable; two-pass path"),
        ("WARNING", "this rank's own trouble"),
        ("DEBUG", "plan of McoreEngine"),
    ]


def test_one_process_without_torch_distributed_says_its_notes():
    logger = logging.getLogger("verl_fused_hook.test_notes_single")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.levelname)

    logger.setLevel(logging.DEBUG)
    logger.addHandler(Keep())
    from verl_fused_hook.log_once import note

    note(logger, "plan")
    assert records == ["INFO"]
