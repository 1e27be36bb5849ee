"""Backend registry: which implementations exist, whether each can run these inputs, and what "auto" picks.

A backend is a module-level `run(problem)` plus a function that returns None when
it can run the problem or a sentence saying why not. "auto" walks PREFERENCE and
logs every backend it passes over, so no fallback is silent: at debug level
on the CPU (where the portable backend is the only choice), and once per
reason at warning level when inputs on a GPU miss a faster backend.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Callable

from .problem import LogProbProblem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    name: str
    module: str  # imported lazily: a GPU backend must not break CPU imports

    def load(self):
        return importlib.import_module(self.module, package=__package__)

    def unavailable_reason(self, problem: LogProbProblem) -> str | None:
        try:
            module = self.load()
        except ImportError as error:
            return f"cannot be imported ({error})"
        check: Callable[[LogProbProblem], str | None] | None = getattr(module, "unavailable_reason", None)
        return check(problem) if check is not None else None


BACKENDS: dict[str, Backend] = {
    "triton": Backend("triton", ".triton_backend"),
    "torch": Backend("torch", ".torch_backend"),
}

# Fastest first; "auto" takes the first whose unavailable_reason is None.
PREFERENCE: tuple[str, ...] = ("triton", "torch")

BACKEND_CHOICES: tuple[str, ...] = ("auto", *BACKENDS)


@functools.cache  # one line per distinct reason, not one per training step
def _warn_once(candidate: str, reason: str) -> None:
    logger.warning("log_probs_and_entropy: backend=auto skips %r on this GPU: %s", candidate, reason)


def resolve_backend(name: str, problem: LogProbProblem) -> Backend:
    """The backend to run `problem` with; ValueError when the named one cannot."""
    if name != "auto":
        backend = BACKENDS[name]
        reason = backend.unavailable_reason(problem)
        if reason is not None:
            raise ValueError(f"backend={name!r} is unavailable here: {reason}; allowed: {', '.join(BACKEND_CHOICES)}")
        return backend
    for candidate in PREFERENCE:
        backend = BACKENDS[candidate]
        reason = backend.unavailable_reason(problem)
        if reason is None:
            return backend
        if problem.hidden.is_cuda:
            _warn_once(candidate, reason)
        else:
            logger.debug("log_probs_and_entropy: backend=auto skips %r: %s", candidate, reason)
    raise ValueError("backend='auto' found no usable backend")  # unreachable: torch always runs
