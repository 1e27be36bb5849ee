"""The backends: the contract between them and the drivers, one registry, and what "auto" picks.

A backend is a module, imported lazily (a GPU backend must not break CPU imports), with `unavailable_reason`
and `build_unavailable_reason` (None when it can run, else a sentence saying why not) and either

- block passes for both drivers (`BlockBackend`): the driver walks the passes' `blocks()`, merges each block's
  `statistics(block)` over tensor-parallel ranks (softmax_math.combine_row_statistics) and hands the merged
  statistics and the upstream gradients back to `gradients(...)`. The two-pass driver (two_pass.py) recomputes
  the logits there and saves the passes' tensors for its backward (`for_backward`); the loss-inside driver
  (loss_inside.py) runs over chunks that chunking.py plans from the backend's `loss_inside_cost`, and keeps each
  chunk's logits from its statistics to its gradients;
- or `run(problem)` (`WholeProblemBackend`): statistics and gradients in one autograd function of its own, which
  the two-pass driver runs whole and the loss-inside driver refuses.

Written as Protocols (typing.Protocol) so a backend's module and its passes say what they implement; nothing
checks them at run time.

"auto" walks PREFERENCE and logs every backend it passes over, so no fallback is silent: at
debug level on the CPU (where the portable backend is the only choice), and once per reason at
warning level when inputs on a GPU miss a faster backend. It never picks "verl".
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from ...log_once import log_once
from ..arguments import LogProbProblem, build_problem
from ..chunking import ChunkCost
from ..softmax_math import LogitGradientInputs, Partials
from ..weight_gradient import WeightGradientSum

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowBlock:
    """One block of scored rows, prepared by a backend for its passes.

    span: where the block sits among the scored rows (slices the per-row statistics and gradients);
    rows: int64 indices of its rows in the problem; hidden: those rows in the form the backend
    multiplies; label_col: the label's column in this shard, -1 where another rank holds it;
    inv_temp: fp32 1 / temperature per row.
    """

    span: slice
    rows: Tensor
    hidden: Tensor
    label_col: Tensor
    inv_temp: Tensor


class BlockPasses(Protocol):
    """One call's passes over its blocks of scored rows."""

    block_count: int

    def blocks(self) -> Iterator[RowBlock]:
        """The blocks, in order (their spans cover the scored rows)."""

    def statistics(self, block: RowBlock) -> Partials:
        """This shard's partials of the block's rows."""

    def gradients(
        self, block: RowBlock, inputs: LogitGradientInputs, want_hidden: bool, weight_sum: WeightGradientSum | None
    ) -> Tensor | None:
        """d_hidden of the block's rows (None unless `want_hidden`); their share of d_weight added into
        `weight_sum` (None: no d_weight wanted)."""


class SavedPasses(NamedTuple):
    """What the two-pass op's forward saves for its backward: `tensors` (save_for_backward), and `rebuild`, which
    makes the backward's passes from them."""

    tensors: tuple[Tensor | None, ...]
    rebuild: Callable[..., BlockPasses]


class TwoPassPasses(BlockPasses, Protocol):
    def for_backward(self) -> SavedPasses:
        """What to save, and how to rebuild the passes that recompute each block's logits in backward."""


class LossInsidePasses(BlockPasses, Protocol):
    # The loss-inside op's final loss evaluation may run on a CUDA stream of its own beside the last chunk's
    # gradient GEMMs (loss_inside.py); False: in stream order after them.
    overlap_final_evaluation: bool


class BlockBackend(Protocol):
    """A backend module with block passes (torch_backend.py, triton_backend.py)."""

    def unavailable_reason(self, p: LogProbProblem) -> str | None: ...

    def build_unavailable_reason(self, hidden_size: int, device_type: str) -> str | None: ...

    def two_pass_passes(self, p: LogProbProblem, for_backward: bool = False) -> TwoPassPasses:
        """Passes whose gradients recompute the logits, except rows kept under `p.keep_logits_bytes` where the
        backend can and `for_backward` says gradients will follow."""

    def loss_inside_cost(self, p: LogProbProblem, keep: bool) -> ChunkCost | None:
        """The memory a chunk of the loss-inside passes takes, from which chunking.plan_chunks plans the chunks;
        None: one block whatever the rows."""

    def loss_inside_passes(self, p: LogProbProblem, keep: bool, spans: list[slice]) -> LossInsidePasses:
        """Passes over the chunks `spans`, keeping each block's logits from its statistics to its gradients when
        `keep`."""


class WholeProblemBackend(Protocol):
    """A backend module whose kernel is one autograd function over the whole problem (verl_backend.py)."""

    def unavailable_reason(self, p: LogProbProblem) -> str | None: ...

    def build_unavailable_reason(self, hidden_size: int, device_type: str) -> str | None: ...

    def run(self, p: LogProbProblem) -> tuple[Tensor, Tensor | None]:
        """fp32 (log_probs, entropy or None) [N], differentiable in hidden and weight."""


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can run, for callers that decide before they hold tensors (the integration).

    per_row_temperature: a temperature tensor shaped like labels; row_selection: rows left out by
    score_mask or ignore_index; padded_vocabulary: vocab_size below V_local * tp size;
    label_is_max: return_label_is_max=True; loss_inside: `log_probs_entropy_and_loss`;
    keep_logits: the two-pass op's keep_logits_bytes (others recompute every row); selected_tokens:
    `token_log_probs` (ids' log-probs, top-k, sum pi^2); batch_invariant_on_cuda: batch_invariant=True on a GPU.
    """

    per_row_temperature: bool = True
    row_selection: bool = True
    padded_vocabulary: bool = True
    label_is_max: bool = True
    loss_inside: bool = True
    keep_logits: bool = False
    selected_tokens: bool = True
    batch_invariant_on_cuda: bool = True


# Why the portable backend refuses batch_invariant=True on a GPU (on the CPU its row blocks are padded: invariant).
BATCH_VARIANT_ON_CUDA = (
    "batch_invariant=True: on CUDA the portable backend's cuBLAS GEMMs and torch reductions pick their kernels by "
    "shape, so a row's values depend on its batch; use backend triton (or verl, whose kernel is invariant)"
)


@dataclass(frozen=True)
class Backend:
    """`module` holds the backend's functions; `whole_problem`: a WholeProblemBackend, else a BlockBackend;
    `selected_tokens_module`: the module with `selected_token_passes` (`token_log_probs`), None without."""

    name: str
    module: str
    capabilities: BackendCapabilities
    whole_problem: bool = False
    selected_tokens_module: str | None = None

    def load(self) -> BlockBackend | WholeProblemBackend:
        return importlib.import_module(self.module, package=__package__)

    def unavailable_reason(self, problem: LogProbProblem) -> str | None:
        if problem.batch_invariant and problem.hidden.is_cuda and not self.capabilities.batch_invariant_on_cuda:
            return BATCH_VARIANT_ON_CUDA
        try:
            module = self.load()
        except ImportError as error:
            return f"cannot be imported ({error})"
        return module.unavailable_reason(problem)


BACKENDS: dict[str, Backend] = {
    "triton": Backend(
        "triton",
        ".triton_backend",
        BackendCapabilities(keep_logits=True),
        selected_tokens_module=".triton_selected_tokens",
    ),
    "torch": Backend(
        "torch",
        ".torch_backend",
        BackendCapabilities(batch_invariant_on_cuda=False),
        selected_tokens_module=".torch_backend",
    ),
    "verl": Backend(
        "verl",
        ".verl_backend",
        BackendCapabilities(
            per_row_temperature=False,
            row_selection=False,
            padded_vocabulary=False,
            label_is_max=False,
            loss_inside=False,
            selected_tokens=False,
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


def backend_unavailable_at_build(
    backend: str, *, hidden_size: int, device_type: str, batch_invariant: bool = False
) -> str | None:
    """None when `backend` can run a model of this hidden size on this device type ("cuda", "cpu"),
    else why not; needs no tensors, so a job can stop at model build instead of its first step.
    Inputs known only per step (dtype, masks, temperatures) are checked per call."""
    check_backend_name(backend)
    if backend == "auto":
        return None
    if batch_invariant and device_type == "cuda" and not BACKENDS[backend].capabilities.batch_invariant_on_cuda:
        return BATCH_VARIANT_ON_CUDA
    try:
        module = BACKENDS[backend].load()
    except ImportError as error:
        return f"cannot be imported ({error})"
    return module.build_unavailable_reason(hidden_size, device_type)


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
        if problem.hidden.is_cuda:  # one line per distinct reason, not one per training step
            log_once(
                logger,
                f"{driver}: backend=auto skips {candidate!r} on this GPU: {reason}",
                logging.WARNING,
                key=(driver, candidate, reason),
            )
        else:
            logger.debug("%s: backend=auto skips %r: %s", driver, candidate, reason)
    reasons = "; ".join(f"{name}: {BACKENDS[name].unavailable_reason(problem)}" for name in PREFERENCE)
    raise ValueError(f"backend='auto' found no backend that runs this call here ({reasons})")


def describe_backends(hidden: torch.Tensor, weight: torch.Tensor) -> dict[str, str | None]:
    """For inputs like `hidden` [N, H] and `weight` [V_local, H] (their dtype and device matter, not their
    values): every backend's reason not to run them (None: it runs), and under "auto" the one auto picks.
    For diagnostics (`verl-fused-hook doctor`); no collective, no logging."""
    problem = build_problem(
        hidden, weight, torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device), temperature=1.0,
        tp_group=None, score_mask=None, ignore_index=-100, vocab_size=None, calculate_entropy=True, tile_rows=None,
    )  # fmt: skip
    reasons = {name: backend.unavailable_reason(problem) for name, backend in BACKENDS.items()}
    reasons["auto"] = next(name for name in PREFERENCE if reasons[name] is None)
    return reasons
