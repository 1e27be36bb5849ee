"""Backend registry: which implementations exist, what each can run, and what "auto" picks.

A backend is a module (imported lazily: a GPU backend must not break CPU imports) with
`unavailable_reason(problem)` and `build_unavailable_reason(hidden_size, device_type)`, each
None when it can run or a sentence saying why not, and either

- block primitives, for both drivers: `two_pass_passes(problem, for_backward)` (gradients recompute
  the logits, except rows kept under `problem.keep_logits_bytes` when the backend can and
  `for_backward` says gradients will follow), `loss_inside_cost(problem, keep)` (a chunking.ChunkCost: the memory a chunk takes, from
  which chunking.py plans the chunks; None: one block whatever the rows) and
  `loss_inside_passes(problem, keep, spans)` (over those chunks, statistics keeping each block's
  logits for its gradients when `keep`). Passes of one call have `block_count`,
  `blocks()` (RowBlocks in order), `statistics(block)` (this shard's Partials of the block),
  `gradients(block, row_max, log_sum, shifted_mean, g_lp, g_ent, want_hidden, weight_sum)`
  (d_hidden of the block or None; d_weight added into the WeightGradientSum), and, for the
  two-pass driver, `for_backward()` (the tensors to save and how to rebuild the passes);
- or `run(problem)`, a whole-problem backend (statistics and gradients in one autograd
  function of its own): the two-pass driver runs it whole, the loss-inside driver refuses it.

"auto" walks PREFERENCE and logs every backend it passes over, so no fallback is silent: at
debug level on the CPU (where the portable backend is the only choice), and once per reason at
warning level when inputs on a GPU miss a faster backend. It never picks "verl".
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass

import torch

from .problem import LogProbProblem

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can run, for callers that decide before they hold tensors (the integration).

    per_row_temperature: a temperature tensor shaped like labels; row_selection: rows left out by
    score_mask or ignore_index; padded_vocabulary: vocab_size below V_local * tp size;
    label_is_max: return_label_is_max=True; loss_inside: `log_probs_entropy_and_loss`;
    keep_logits: the two-pass op's keep_logits_bytes (others recompute every row).
    """

    per_row_temperature: bool = True
    row_selection: bool = True
    padded_vocabulary: bool = True
    label_is_max: bool = True
    loss_inside: bool = True
    keep_logits: bool = False


@dataclass(frozen=True)
class Backend:
    """`module` holds the backend's functions; `whole_problem`: it has `run(problem)`, not block primitives."""

    name: str
    module: str
    capabilities: BackendCapabilities
    whole_problem: bool = False

    def load(self):
        return importlib.import_module(self.module, package=__package__)

    def unavailable_reason(self, problem: LogProbProblem) -> str | None:
        try:
            module = self.load()
        except ImportError as error:
            return f"cannot be imported ({error})"
        return module.unavailable_reason(problem)


BACKENDS: dict[str, Backend] = {
    "triton": Backend("triton", ".triton_backend", BackendCapabilities(keep_logits=True)),
    "torch": Backend("torch", ".torch_backend", BackendCapabilities()),
    "verl": Backend(
        "verl",
        ".verl_backend",
        BackendCapabilities(
            per_row_temperature=False, row_selection=False, padded_vocabulary=False, label_is_max=False, loss_inside=False
        ),
        whole_problem=True,
    ),
}

# Fastest first; "auto" takes the first whose unavailable_reason is None.
PREFERENCE: tuple[str, ...] = ("triton", "torch")

BACKEND_CHOICES: tuple[str, ...] = ("auto", *BACKENDS)


def check_backend_name(backend) -> None:
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend: unknown {backend!r}; allowed: {', '.join(BACKEND_CHOICES)}")


def backend_capabilities(backend: str) -> BackendCapabilities:
    """What `backend` can run; "auto" can run everything (the portable backend takes any input), keeping
    logits where it picks the Triton backend."""
    check_backend_name(backend)
    return BackendCapabilities(keep_logits=True) if backend == "auto" else BACKENDS[backend].capabilities


def backend_unavailable_at_build(backend: str, *, hidden_size: int, device_type: str) -> str | None:
    """None when `backend` can run a model of this hidden size on this device type ("cuda", "cpu"),
    else why not; needs no tensors, so a job can stop at model build instead of its first step.
    Inputs known only per step (dtype, masks, temperatures) are checked per call."""
    check_backend_name(backend)
    if backend == "auto":
        return None
    try:
        module = BACKENDS[backend].load()
    except ImportError as error:
        return f"cannot be imported ({error})"
    return module.build_unavailable_reason(hidden_size, device_type)


@functools.cache  # one line per distinct reason, not one per training step
def _warn_once(driver: str, candidate: str, reason: str) -> None:
    logger.warning("%s: backend=auto skips %r on this GPU: %s", driver, candidate, reason)


def resolve_backend(name: str, problem: LogProbProblem, driver: str = "log_probs_and_entropy") -> Backend:
    """The backend to run `problem` with in `driver` (the op's name); ValueError when the named one cannot."""
    check_backend_name(name)
    loss_inside = driver == "log_probs_entropy_and_loss"
    if name != "auto":
        backend = BACKENDS[name]
        if loss_inside and not backend.capabilities.loss_inside:
            raise ValueError(
                f"backend={name!r} cannot run {driver}: its kernel computes statistics and gradients in one call, "
                f"so no loss fits between them; allowed: "
                f"{', '.join(n for n in BACKEND_CHOICES if backend_capabilities(n).loss_inside)}"
            )
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
            _warn_once(driver, candidate, reason)
        else:
            logger.debug("%s: backend=auto skips %r: %s", driver, candidate, reason)
    raise ValueError("backend='auto' found no usable backend")  # unreachable: torch always runs


def describe_backends(hidden: torch.Tensor, weight: torch.Tensor) -> dict[str, str | None]:
    """For inputs like `hidden` [N, H] and `weight` [V_local, H] (their dtype and device matter, not their
    values): every backend's reason not to run them (None: it runs), and under "auto" the one auto picks.
    For diagnostics (`verl-fused-hook doctor`); no collective, no logging."""
    from .interface import build_problem

    problem = build_problem(
        hidden, weight, torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device), temperature=1.0,
        tp_group=None, score_mask=None, ignore_index=-100, vocab_size=None, calculate_entropy=True, tile_rows=None,
    )  # fmt: skip
    reasons = {name: backend.unavailable_reason(problem) for name, backend in BACKENDS.items()}
    reasons["auto"] = next(name for name in PREFERENCE if reasons[name] is None)
    return reasons
