"""Independent fp64 reference for log-probs, entropy and their gradients (full logits, autograd), and the
gradients' error measure (Frobenius, relative) the accuracy checks state their tolerances in (tests, doctor,
bench); the elementwise measures are support/compare.py's."""

from __future__ import annotations

import torch


def reference_log_probs_entropy(
    hidden, weight, labels, *, temperature=1.0, vocab_size=None, active=None, grad_outputs=None
):
    """fp64 log-probs/entropy of softmax(hidden @ weight[:vocab].T / T) and, given
    (g_log_probs, g_entropy), the gradients of sum(g_lp * lp + g_H * H) w.r.t. hidden and weight.

    `active` (bool, shaped like labels) marks rows that are computed; others are 0.
    """
    h = hidden.detach().double().requires_grad_(True)
    w = weight.detach().double().requires_grad_(True)
    vocab = vocab_size if vocab_size is not None else w.shape[0]
    t = temperature.double().unsqueeze(-1) if isinstance(temperature, torch.Tensor) else float(temperature)
    logits = h @ w[:vocab].t() / t
    log_softmax = torch.log_softmax(logits, dim=-1)
    if active is None:
        active = torch.ones_like(labels, dtype=torch.bool)
    safe = torch.where(active, labels, torch.zeros_like(labels))
    log_probs = log_softmax.gather(-1, safe.unsqueeze(-1)).squeeze(-1) * active
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) * active
    grads = (None, None)
    if grad_outputs is not None:
        g_lp, g_h = grad_outputs
        (log_probs * g_lp.double() + entropy * g_h.double()).sum().backward()
        grads = (h.grad, w.grad)
    return log_probs.detach(), entropy.detach(), grads[0], grads[1]


def relative_error(a, b) -> float:
    """Frobenius norm of the difference relative to the reference's norm (gradients)."""
    scale = b.double().norm().item()
    difference = (a.double() - b.double()).norm().item()
    return difference / scale if scale > 0 else difference
