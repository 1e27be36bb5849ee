"""The bench's sampling-replay methods (issue 54): log-probs and entropy renormalized over each token's kept set.

replay_given_{20,64,512}: `replayed_log_probs` on given sets of that many uniformly random ids per row (the label
among them): the worst case for the sets' sharing between neighbouring rows. replay_given_mix: sets shaped like
top-p sets: sizes log-uniform in 1..512, ids drawn by a Zipf(1.1) popularity over the vocabulary (common tokens in
most sets), so neighbouring rows share most columns. replay_trainer: the sets computed in the trainer with vLLM's rule
(top_k 50, top_p 0.9) from the row's own logits, then the sparse pass. replay_masked_logits: what users write
today: full fp32 logits / T, -inf outside the set, log_softmax (and its backward), on the mix's sets.

The sets are synthetic inputs, made once per shape and kind. Each method carries `accuracy`: its log-probs,
entropy and gradients against fp64 logits masked to the same sets (for replay_trainer: to the sets it returned, and
how many rows' sets differ from vLLM's rule on the fp64 logits).
"""

from __future__ import annotations

import functools
import math

import torch

from verl_fused_hook.ops import replayed_log_probs

from ...support.compare import max_abs
from ...support.reference import relative_error

TRAINER_TOP_K, TRAINER_TOP_P = 50, 0.9
MIX_LARGEST = 512


@functools.lru_cache(maxsize=8)  # every kind of one shape: the methods are timed in interleaved rounds
def kept_sets(n: int, vocab: int, kind: str, device: str) -> torch.Tensor:
    """int64 [n, k_max] kept ids (-1 padding), each id once per row."""
    g = torch.Generator(device=device).manual_seed(n * 7 + vocab)
    if kind == "mix":
        sizes = torch.exp(torch.rand(n, device=device, generator=g) * math.log(MIX_LARGEST)).long().clamp(1)
        popularity = -1.1 * torch.log(torch.arange(1, vocab + 1, device=device, dtype=torch.float32))
        popularity = popularity[torch.randperm(vocab, device=device, generator=g)]
        width = MIX_LARGEST
        ids = torch.empty(n, width, dtype=torch.int64, device=device)
        for start in range(0, n, 4096):  # Gumbel top-k: `width` draws without replacement by popularity
            rows = min(4096, n - start)
            gumbel = -torch.log(-torch.log(torch.rand(rows, vocab, device=device, generator=g).clamp_min(1e-20)))
            ids[start : start + rows] = torch.topk(popularity + gumbel, width, dim=1).indices
    else:  # uniformly random ids: a few random permutations, each row's shifted by its own offset
        width = int(kind)
        sizes = torch.full((n,), width, device=device)
        ids = torch.stack([torch.randperm(vocab, device=device, generator=g)[:width] for _ in range(min(n, 64))])
        ids = ids[torch.randint(0, ids.shape[0], (n,), device=device, generator=g)]
        ids = (ids + torch.randint(0, vocab, (n, 1), device=device, generator=g)) % vocab
    return torch.where(torch.arange(width, device=device) < sizes.unsqueeze(1), ids, -1)


def given_sets(kind: str):
    def fn(h, w, labels, temperature, score_mask=None):
        kept = _sets_for(labels, w.shape[0], kind)
        out = replayed_log_probs(h, w, labels, temperature=temperature, kept_ids=kept, score_mask=score_mask)
        return out.log_probs, out.entropy

    fn.accuracy = functools.partial(replay_accuracy, fn, kind)
    return fn


def trainer_side():
    def fn(h, w, labels, temperature, score_mask=None):
        out = replayed_log_probs(
            h, w, labels, temperature=temperature, top_k=TRAINER_TOP_K, top_p=TRAINER_TOP_P, score_mask=score_mask
        )
        fn.last_sets = out.kept_ids
        return out.log_probs, out.entropy

    fn.accuracy = functools.partial(replay_accuracy, fn, None)
    return fn


def masked_logits():
    """Full logits, a mask, log_softmax: today's replay (prime-rl, SkyRL), with the fused head switched off."""

    def fn(h, w, labels, temperature, score_mask=None):
        kept = _sets_for(labels, w.shape[0], "mix")
        z = (h @ w.t()).float() / temperature
        keep = torch.zeros_like(z, dtype=torch.bool).scatter_(1, kept.clamp_min(0), kept >= 0)
        log_softmax = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
        entropy = -(log_softmax.exp() * torch.where(keep, log_softmax, 0.0)).sum(-1)
        return log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy

    fn.accuracy = functools.partial(replay_accuracy, fn, "mix")
    return fn


def _sets_for(labels: torch.Tensor, vocab: int, kind: str) -> torch.Tensor:
    """The synthetic sets with each row's label in slot 0 (and nowhere else)."""
    kept = kept_sets(labels.numel(), vocab, kind, str(labels.device))
    kept = torch.where(kept == labels.unsqueeze(1), kept[:, :1], kept)  # the label's place takes slot 0's id
    kept[:, 0] = labels
    return kept


def replay_accuracy(fn, kind: str | None, hidden, weight, labels, temperature) -> dict:
    """Max abs error of log-probs / entropy and relative error of both gradients against fp64 logits masked to the
    method's sets; for computed sets, the rows whose set differs from vLLM's rule on the fp64 logits (plus the
    label)."""
    g = torch.Generator(device=hidden.device).manual_seed(5)
    g_lp, g_ent = (
        torch.randn(labels.shape, device=hidden.device, generator=g),
        torch.randn(labels.shape, device=hidden.device, generator=g),
    )
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    lp, ent = fn(h, w, labels, temperature, None)
    dh, dw = torch.autograd.grad([lp, ent], (h, w), [g_lp, g_ent])
    kept = fn.last_sets if kind is None else _sets_for(labels, weight.shape[0], kind)
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = hd @ wd.t() / temperature
    keep = torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter_(1, kept.clamp_min(0), kept >= 0)
    result = {}
    if kind is None:  # the bench's labels are random: each joins its row's set (label_added)
        rule = _vllm_keep(z.detach())
        rule[torch.arange(labels.numel(), device=labels.device), labels] = True
        result["sets_differ_rows"] = int((keep != rule).any(dim=1).sum())
    log_softmax = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    want_lp = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    want_ent = -(log_softmax.exp() * torch.where(keep, log_softmax, 0.0)).sum(-1)
    want_dh, want_dw = torch.autograd.grad([want_lp, want_ent], (hd, wd), [g_lp.double(), g_ent.double()])
    return result | {
        "log_prob_max_err": max_abs(want_lp.detach(), lp.detach()),
        "entropy_max_err": max_abs(want_ent.detach(), ent.detach()),
        "d_hidden_rel_err": relative_error(dh, want_dh),
        "d_weight_rel_err": relative_error(dw, want_dw),
    }


def _vllm_keep(z: torch.Tensor) -> torch.Tensor:
    """vLLM's top-k then top-p keep mask on fp64 logits already divided by T (ties at the k-th value kept)."""
    z_sorted, order = z.sort(dim=1)
    kth = z_sorted[:, z.shape[1] - TRAINER_TOP_K].unsqueeze(1)
    z_sorted = z_sorted.masked_fill(z_sorted < kth, float("-inf"))
    drop = z_sorted.softmax(dim=1).cumsum(dim=1) <= 1 - TRAINER_TOP_P
    drop[:, -1] = False
    kept_sorted = torch.isfinite(z_sorted) & ~drop
    return torch.zeros_like(kept_sorted).scatter(1, order, kept_sorted)


def loaders() -> dict:
    """The bench's replay methods, by name."""
    return {
        "replay_given_20": lambda: given_sets("20"),
        "replay_given_64": lambda: given_sets("64"),
        "replay_given_512": lambda: given_sets("512"),
        "replay_given_mix": lambda: given_sets("mix"),
        "replay_trainer": trainer_side,
        "replay_masked_logits": masked_logits,
    }
