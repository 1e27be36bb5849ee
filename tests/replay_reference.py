"""Test-only references for sampling replay, on full logits in fp64.

`vllm_keep_mask` is written from vLLM's documented sampler semantics (vllm/v1/sample/ops/topk_topp_sampler.py,
`apply_top_k_top_p_pytorch`): logits divided by the temperature, sorted ascending; top-k masks the values strictly
below the k-th largest (ties at the k-th value stay); top-p, on the top-k-masked row: softmax, cumulative sum in
ascending order, mask where it is <= 1 - p, the largest always kept. `replayed_reference` is log_softmax over the kept
set by fp64 autograd: the label's log-prob, the entropy, given ids' log-probs, and both gradients.
"""

from __future__ import annotations

import torch


def vllm_keep_mask(logits: torch.Tensor, temperature: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """bool [N, V]: the tokens vLLM's top-k / top-p keeps for each row of fp64 logits [N, V]."""
    z = logits.double() / temperature.double().unsqueeze(1)
    z_sorted, order = z.sort(dim=1, descending=False)
    if top_k > 0:
        kth = z_sorted[:, z.shape[1] - top_k].unsqueeze(1)
        z_sorted = z_sorted.masked_fill(z_sorted < kth, float("-inf"))
    if top_p < 1.0:
        cumulative = z_sorted.softmax(dim=1).cumsum(dim=1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False
        z_sorted = z_sorted.masked_fill(drop, float("-inf"))
    kept_sorted = torch.isfinite(z_sorted)
    return torch.zeros_like(kept_sorted).scatter(1, order, kept_sorted)


def replayed_reference(hidden, weight, labels, keep, temperature, active, g_lp, g_ent, token_ids=None, g_tok=None):
    """fp64 log p_S(label), entropy over S, log p_S(token_ids) (-inf outside S), d_hidden and d_weight of
    sum(g_lp lp + g_ent H + g_tok tok) over the `active` rows (others 0)."""
    hd = hidden.double().requires_grad_()
    wd = weight.double().requires_grad_()
    z = hd @ wd.t() / temperature.double().unsqueeze(1)
    z = z.masked_fill(~keep, float("-inf"))
    log_p = torch.log_softmax(z, dim=1)
    p = log_p.exp()
    lp = torch.where(active, log_p.gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1), 0.0)
    ent = torch.where(active, -(p * torch.where(keep, log_p, 0.0)).sum(1), 0.0)
    total = (lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()
    tok = None
    if token_ids is not None:
        tok = log_p.gather(1, token_ids)
        inside = keep.gather(1, token_ids) & active.unsqueeze(1)
        total = total + torch.where(inside, tok * g_tok.double(), 0.0).sum()
        tok = torch.where(active.unsqueeze(1), tok, 0.0)
    total.backward()
    return lp.detach(), ent.detach(), None if tok is None else tok.detach(), hd.grad, wd.grad
