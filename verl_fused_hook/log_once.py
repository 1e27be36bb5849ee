"""The package's log lines said once, and notes (INFO) on the first rank only: one record for the op and the plugin.

Why: a line such as "loss X is not separable; two-pass path" is true for the whole job, so it is said once, at
the level and by the logger (module) that knows it, however many steps repeat it; and every rank of a job holds
the same configuration, so a job on 512 GPUs should say it once, not 512 times. Warnings and errors, which may
be one rank's own, are logged on every rank; the other ranks log notes at DEBUG. The op's own notes (a keep-logits
budget its backend ignores, a main_grad the output layer cannot use) are said on every rank, as they always were.
Imports nothing of the package, so the op (ops/) may use it too.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

# (logger name, what was said): the level and message, or the caller's key
_said: set[tuple[str, object]] = set()


def level_on_this_rank(level: int) -> int:
    """`level`, or DEBUG for a note (below WARNING) on any global rank but 0."""
    if level < logging.WARNING and dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return logging.DEBUG
    return level


def log_once(
    logger: logging.Logger,
    message: str,
    level: int = logging.INFO,
    *,
    key=None,
    later: int | None = None,
    every_rank: bool = False,
) -> None:
    """`logger.log(level, message)` the first time this logger is given `key` (default: this message at this level);
    after that at level `later`, or not at all (None). A note (below WARNING) goes to DEBUG on every rank but the
    first, unless `every_rank`."""
    if not every_rank:
        level = level_on_this_rank(level)
    said = (logger.name, (level, message) if key is None else key)
    if said in _said:
        if later is not None:
            logger.log(later, message)
        return
    _said.add(said)
    logger.log(level, message)


def note(logger: logging.Logger, message: str, *args) -> None:
    """`logger.info(message, *args)` on the first rank, DEBUG elsewhere: what a model build decided."""
    logger.log(level_on_this_rank(logging.INFO), message, *args)
