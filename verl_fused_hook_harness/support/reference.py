"""Independent fp64 reference for log-probs, entropy and their gradients (full logits, autograd), and the
gradients' error measure (Frobenius, relative) the accuracy checks state their tolerances in (tests, doctor,
bench); the elementwise measures are support/compare.py's."""

from __future__ import annotations

import torch

# fp64 logits of one row chunk: 2^25 elements (256 MiB), so the reference of 16384 x 151936 fits beside the op on an
# 80 GB card (whole, its logits, softmax and autograd graph took ~80 GB); rows are independent, so chunking changes
# nothing but the weight gradient's fp64 summation order.
_CHUNK_ELEMENTS = 1 << 25


def reference_log_probs_entropy(
    hidden,
    weight,
    labels,
    *,
    temperature=1.0,
    vocab_size=None,
    active=None,
    grad_outputs=None,
    chunk_elements=_CHUNK_ELEMENTS,
):
    """fp64 log-probs/entropy of softmax(hidden @ weight[:vocab].T / T) and, given
    (g_log_probs, g_entropy), the gradients of sum(g_lp * lp + g_H * H) w.r.t. hidden and weight.

    `labels` shaped like hidden's rows gives a row's log-prob; with one more dimension ([..., k]) the log-probs at
    those k columns (top-k losses). `active` (bool, shaped like the rows) marks rows that are computed; others are 0.
    `chunk_elements` bounds a row chunk's logits.
    """
    rows_shape = hidden.shape[:-1]
    vocab = vocab_size if vocab_size is not None else weight.shape[0]
    with_grads = grad_outputs is not None
    w = weight.detach().double().requires_grad_(with_grads)
    flat_hidden = hidden.detach().reshape(-1, hidden.shape[-1])
    rows = flat_hidden.shape[0]
    columns = labels.reshape(rows, 1 if labels.dim() == len(rows_shape) else labels.shape[-1])
    keep = (torch.ones(rows_shape, dtype=torch.bool, device=hidden.device) if active is None else active).reshape(-1, 1)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.detach().double().expand(rows_shape).reshape(-1, 1)
    if with_grads:
        g_lp = grad_outputs[0].double().reshape(columns.shape)
        g_h = grad_outputs[1].double().reshape(rows)
        d_hidden = torch.zeros(flat_hidden.shape, dtype=torch.float64, device=hidden.device)
    log_probs = torch.empty(columns.shape, dtype=torch.float64, device=hidden.device)
    entropy = torch.empty(rows, dtype=torch.float64, device=hidden.device)
    step = max(1, chunk_elements // max(vocab, 1))
    for start in range(0, rows, step):
        part = slice(start, start + step)
        h = flat_hidden[part].double().requires_grad_(with_grads)
        with torch.enable_grad():
            t = temperature[part] if isinstance(temperature, torch.Tensor) else float(temperature)
            log_softmax = torch.log_softmax(h @ w[:vocab].t() / t, dim=-1)
            lp = log_softmax.gather(-1, torch.where(keep[part], columns[part], 0)) * keep[part]
            ent = -(log_softmax.exp() * log_softmax).sum(-1) * keep[part, 0]
            if with_grads:
                (lp * g_lp[part]).sum().add((ent * g_h[part]).sum()).backward()
                d_hidden[part] = h.grad
        log_probs[part], entropy[part] = lp.detach(), ent.detach()
    if not with_grads:
        return log_probs.reshape(labels.shape), entropy.reshape(rows_shape), None, None
    d_weight = w.grad if w.grad is not None else torch.zeros_like(w)
    return log_probs.reshape(labels.shape), entropy.reshape(rows_shape), d_hidden.reshape(hidden.shape), d_weight


def loss_reference(hidden, weight, columns, loss_of_log_probs, *, temperature=1.0, chunk_elements=_CHUNK_ELEMENTS):
    """fp64 (loss, d_hidden, d_weight) of a loss of the log-probs at `columns` (and the entropy, when the loss
    takes two arguments), in row chunks: the loss's gradient w.r.t. those log-probs, then their chain rule."""
    chunked = {"temperature": temperature, "chunk_elements": chunk_elements}
    log_probs, entropy, _, _ = reference_log_probs_entropy(hidden, weight, columns, **chunked)
    log_probs.requires_grad_(True)
    entropy.requires_grad_(True)
    loss = loss_of_log_probs(log_probs, entropy)
    g_lp, g_h = torch.autograd.grad(loss, (log_probs, entropy), allow_unused=True, materialize_grads=True)
    _, _, d_hidden, d_weight = reference_log_probs_entropy(hidden, weight, columns, grad_outputs=(g_lp, g_h), **chunked)
    return loss.detach(), d_hidden, d_weight


def relative_error(a, b) -> float:
    """Frobenius norm of the difference relative to the reference's norm (gradients)."""
    scale = b.double().norm().item()
    difference = (a.double() - b.double()).norm().item()
    return difference / scale if scale > 0 else difference
