"""The loss inside the op: its per-row gradients, and the check that they were right to use.

Why: the loss-inside op differentiates a chunk's rows before later chunks' log-probs exist
(they hold 0 then). That is exact only for a token-separable loss, whose row i's gradient
depends on row i's values alone. So after the last chunk the loss is evaluated once more on
the real values and its per-row gradients must equal those used; otherwise
NonSeparableLossError. A gradient that is NaN or infinite is reported as that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

# loss_fn(log_probs, entropy or None), both fp32 shaped like labels -> (scalar loss, metrics)
LossFunction = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, Any]]
# row_gradients(rows, log_probs of those rows, entropy of those rows or None) -> (d loss/d log_prob,
# d loss/d entropy or None) of those rows: a cheap stand-in for differentiating loss_fn once per chunk.
RowGradients = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]

# Per-row gradients of a token-separable loss do not depend on other rows' values: the
# two evaluations agree to the last bits; anything beyond this is a dependency on other rows.
SEPARABILITY_RTOL = 1e-6
# With row_groups (a sequence-level loss: GSPO's ratio is the exp of a mean over the sequence) a row's
# gradient carries an fp32 sum over its group, which the chunk's evaluation (on the device) and the final one
# (on the host) round in different orders: up to ~L * 6e-8 of the sum, times exp's slope, for groups of L
# rows (1e-5 relative at 2048 rows with |log-ratio| ~ 10, as the bench's synthetic batch has). A group split
# across chunks moves gradients by O(1), so a looser bound still catches it.
GROUP_SEPARABILITY_RTOL = 1e-3


class NonSeparableLossError(RuntimeError):
    """The loss's gradient for a row depends on other rows: the one-pass gradient would be wrong."""


class NonFiniteLossGradientError(RuntimeError):
    """The loss's gradient is NaN or infinite at some scored row: the fused gradient would carry it."""


class LossGradientError(RuntimeError):
    """A gradient reached the log-probs or entropy returned next to the fused loss."""


def gradient_reached_outputs(loss_name: str, what: str) -> LossGradientError:
    return LossGradientError(
        f"loss {loss_name}: a gradient reached the {what} returned by log_probs_entropy_and_loss; "
        "the fused op only back-propagates its own loss, so a further loss on its outputs would be "
        "dropped. Fold that term into loss_fn, or use log_probs_and_entropy"
    )


@dataclass
class LossCall:
    """One call's loss and what goes with it; `metrics` is filled by the final evaluation."""

    loss_fn: LossFunction
    loss_name: str
    shape: torch.Size
    row_gradients: RowGradients | None = None
    host_loss_fn: LossFunction | None = None
    grouped: bool = False  # row_groups given: per-row gradients carry per-group sums (GROUP_SEPARABILITY_RTOL)
    metrics: Any = field(default=None)


class Evaluation(NamedTuple):
    """loss_fn on full-length values: the loss (scalar) and metrics, and, when asked for, its fp32 gradients in the
    log-probs and entropy (g_ent None without the entropy)."""

    loss: torch.Tensor
    metrics: Any
    g_lp: torch.Tensor | None
    g_ent: torch.Tensor | None


def evaluate(
    call: LossCall,
    log_probs: torch.Tensor,
    entropy: torch.Tensor | None,
    with_grad: bool,
    loss_fn: LossFunction | None = None,
) -> Evaluation:
    """loss_fn (default call.loss_fn) on full-length values; with_grad: also its fp32 gradients in log_probs and
    entropy (zeros if unused), else None for both."""
    loss_fn = loss_fn or call.loss_fn
    if not with_grad:
        loss, metrics = loss_fn(log_probs.view(call.shape), None if entropy is None else entropy.view(call.shape))
        return Evaluation(loss, metrics, None, None)
    with torch.enable_grad():
        lp = log_probs.detach().requires_grad_(True)
        ent = None if entropy is None else entropy.detach().requires_grad_(True)
        loss, metrics = loss_fn(lp.view(call.shape), None if ent is None else ent.view(call.shape))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                f"loss_fn ({call.loss_name}): must return (scalar tensor, metrics), got {type(loss).__name__}"
            )
        inputs = [lp] if ent is None else [lp, ent]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True) if loss.requires_grad else [None] * len(inputs)
    g_lp = grads[0] if grads[0] is not None else torch.zeros_like(log_probs)
    g_ent = None
    if ent is not None:
        g_ent = grads[1] if grads[1] is not None else torch.zeros_like(entropy)
    return Evaluation(loss.detach().reshape(()), metrics, g_lp.float(), g_ent if g_ent is None else g_ent.float())


def chunk_row_gradients(call: LossCall, rows, log_probs, entropy, chunk_log_probs, chunk_entropy):
    """fp32 (g_lp, g_ent) of the chunk's rows: from call.row_gradients, else by differentiating loss_fn on
    full-length values (rows not yet computed hold 0). g_ent is None when the entropy is not computed."""
    if call.row_gradients is not None:
        g_lp, g_ent = call.row_gradients(rows, chunk_log_probs, chunk_entropy)
    else:
        _, _, g_lp_all, g_ent_all = evaluate(call, log_probs, entropy, with_grad=True)
        g_lp = g_lp_all.index_select(0, rows)
        g_ent = None if g_ent_all is None else g_ent_all.index_select(0, rows)
    g_lp = g_lp.float()
    if chunk_entropy is None:
        return g_lp, None
    return g_lp, torch.zeros_like(g_lp) if g_ent is None else g_ent.float()


def _source(call: LossCall, used: bool) -> str:
    """Which function produced the gradients that were used (per chunk) or checked (final evaluation)."""
    if used:
        return "its row_gradients" if call.row_gradients is not None else "autograd of the loss"
    return "autograd of its host_loss_fn" if call.host_loss_fn is not None else "autograd of the loss"


def check_finite(call: LossCall, values: torch.Tensor, rows: torch.Tensor, what: str, source: str) -> None:
    """NonFiniteLossGradientError when a gradient at a scored row (values: already of `rows`) is NaN/inf."""
    finite = torch.isfinite(values)
    if not bool(finite.all()):
        first = int(rows[(~finite).nonzero()[0, 0]])
        raise NonFiniteLossGradientError(
            f"loss {call.loss_name}: its gradient is not finite (NaN/inf) in the {what} of "
            f"{int((~finite).sum())} scored rows (first: row {first}, from {source}); the fused "
            "gradients would carry it into hidden and weight. Check the loss for NaN/inf inputs or a log/division "
            "at 0"
        )


def check_separable(call: LossCall, used: torch.Tensor, exact: torch.Tensor, rows: torch.Tensor, what: str) -> None:
    """NonFiniteLossGradientError when a gradient at a scored row is NaN/inf; NonSeparableLossError when the
    gradients used per chunk differ from those of the final evaluation."""
    used, exact = used.index_select(0, rows), exact.index_select(0, rows)
    for values, was_used in ((exact, False), (used, True)):
        check_finite(call, values, rows, what, _source(call, was_used))
    scale = exact.abs().max() if exact.numel() else exact.new_zeros(())
    rtol = GROUP_SEPARABILITY_RTOL if call.grouped else SEPARABILITY_RTOL
    if not bool(((used - exact).abs() <= rtol * scale).all()):
        worst = float((used - exact).abs().max())
        if call.host_loss_fn is not None:
            raise NonSeparableLossError(
                f"loss {call.loss_name}: autograd of its host_loss_fn (the final evaluation, on the host) disagrees "
                f"with the gradients used in the {what} (by up to {worst:.3e}): host_loss_fn must be loss_fn over "
                "host copies of its inputs, and the loss token-separable"
            )
        if call.row_gradients is not None:
            raise NonSeparableLossError(
                f"loss {call.loss_name}: its row_gradients disagree with autograd of the loss in the {what} "
                f"(by up to {worst:.3e}); the fused gradient would be wrong"
            )
        raise NonSeparableLossError(
            f"loss {call.loss_name}: its gradient in the {what} of a row depends on other rows' values "
            f"(per-chunk and whole-batch gradients differ by up to {worst:.3e}), so it is not token-separable "
            "and cannot be fused; compute it on the outputs of log_probs_and_entropy instead"
        )
