"""Test-only references for sampling replay, on full logits in fp64.

The kept sets come from `vllm_keep_mask` (vLLM's top-k / top-p rule on full logits, written from vLLM's documented
semantics), the harness's rollout sampler's (support/truncated_sampling.py): the op's sets are judged by the rule the
rollouts are drawn with. `replayed_reference` is log_softmax over the kept set by fp64 autograd: the label's
log-prob, the entropy, given ids' log-probs, and both gradients.
"""

from __future__ import annotations

import torch


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
