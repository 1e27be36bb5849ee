"""The loss-inside op's two-pass path: what a call runs when no chunk plan works (chunking.py says why, in the log).

Why: a sequence longer than a chunk, or a GPU short of memory for the smallest chunk, must not fail a job
that the two-pass op would run. So the call takes the two-pass op's passes on the problem it built
(statistics now, logits recomputed in backward: four GEMMs), and loss_fn is evaluated once on the final
values, as the fused path's final evaluation: exact for any loss, no per-chunk gradients, no separability
to prove. The result keeps the fused path's contract: the loss back-propagates (the loss's gradients in
the log-probs and entropy, checked finite, scale the two-pass backward), metrics are loss_fn's, and a
gradient reaching the returned log-probs or entropy raises LossGradientError.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .problem import LogProbProblem
from .separability import LossCall, check_finite, evaluate, gradient_reached_outputs
from .two_pass import run_passes


class _LinearizedLoss(torch.autograd.Function):
    """The loss's value; backward hands grad * (d loss / d log_probs, d loss / d entropy) to the two-pass op."""

    @staticmethod
    def forward(ctx, loss, log_probs, entropy, g_lp, g_ent):
        ctx.g_lp, ctx.g_ent = g_lp, g_ent
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        def scaled(g):
            return None if g is None else (g if bool(grad == 1) else g * grad)

        return None, scaled(ctx.g_lp), scaled(ctx.g_ent), None, None


class _RefuseGradient(torch.autograd.Function):
    """Identity on the returned log-probs or entropy; a nonzero gradient reaching them raises, as on the fused path."""

    @staticmethod
    def forward(ctx, values, loss_name, what):
        ctx.loss_name, ctx.what = loss_name, what
        ctx.set_materialize_grads(False)
        return values.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if grad is not None and bool(grad.ne(0).any()):
            raise gradient_reached_outputs(ctx.loss_name, ctx.what)
        return None, None, None


def two_pass_loss(p: LogProbProblem, call: LossCall, module):
    """(loss, metrics, log_probs [N], entropy [N] or None) of the call through `module`'s two-pass passes."""
    log_probs, entropy = run_passes(p, module)
    if not p.needs_grad:
        loss, metrics, _, _ = evaluate(call, log_probs, entropy, with_grad=False)
        return loss, metrics, log_probs, entropy
    loss, metrics, g_lp, g_ent = evaluate(call, log_probs.detach(), None if entropy is None else entropy.detach(), True)
    rows = p.active_rows
    check_finite(call, g_lp.index_select(0, rows), rows, "log-prob", "autograd of the loss")
    if g_ent is not None:
        check_finite(call, g_ent.index_select(0, rows), rows, "entropy", "autograd of the loss")
    loss = _LinearizedLoss.apply(loss, log_probs, entropy, g_lp, g_ent)
    log_probs = _RefuseGradient.apply(log_probs, call.loss_name, "log-probs")
    if entropy is not None:
        entropy = _RefuseGradient.apply(entropy, call.loss_name, "entropy")
    return loss, metrics, log_probs, entropy
