"""The plugin's notes in the log: once per distinct message, and notes (INFO) on the first rank only.

Why: a note such as "loss X is not separable; two-pass path" is true for the whole job, so it is said once, at
the level and by the logger (module) that knows it, however many steps repeat it; and every rank of a job holds
the same configuration, so a job on 512 GPUs should say it once, not 512 times. Warnings and errors, which may
be one rank's own, are logged on every rank; the other ranks log notes at DEBUG.
"""

from __future__ import annotations

import functools
import logging

import torch.distributed as dist


def level_on_this_rank(level: int) -> int:
    """`level`, or DEBUG for a note (below WARNING) on any global rank but 0."""
    if level < logging.WARNING and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return logging.DEBUG
    return level


@functools.cache
def _emit_once(logger_name: str, level: int, message: str) -> None:
    logging.getLogger(logger_name).log(level, message)


def log_once(logger: logging.Logger, message: str, level: int = logging.INFO) -> None:
    """`logger.log(level, message)` the first time this logger is given this message at this level (a note: on
    the first rank, DEBUG elsewhere)."""
    _emit_once(logger.name, level_on_this_rank(level), message)


def note(logger: logging.Logger, message: str, *args) -> None:
    """`logger.info(message, *args)` on the first rank, DEBUG elsewhere: what a model build decided."""
    logger.log(level_on_this_rank(logging.INFO), message, *args)
