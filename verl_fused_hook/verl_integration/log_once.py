"""One log line per distinct message: the plugin's notes are about configurations, which repeat every step.

Why one helper: a note such as "loss X is not separable; two-pass path" is true for the whole job, so it is
said once, at the level and by the logger (module) that knows it, however many steps repeat it.
"""

from __future__ import annotations

import functools
import logging


@functools.cache
def _emit_once(logger_name: str, level: int, message: str) -> None:
    logging.getLogger(logger_name).log(level, message)


def log_once(logger: logging.Logger, message: str, level: int = logging.INFO) -> None:
    """`logger.log(level, message)` the first time this logger is given this message at this level."""
    _emit_once(logger.name, level, message)
