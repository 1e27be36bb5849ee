"""The kept sets of sampling replay: each row's token ids that the rollout's top-k / top-p truncation kept.

Two sources. Given: the rollout returns them (vLLM >= 0.28's `SamplingMask(token_ids, offsets)`, CSR over the
generated tokens, or ids padded to [rows, k_max] with -1); `given_kept_ids` checks and pads them. Computed in the
trainer: `vllm_kept_prefix` applies vLLM's rule to a row's top candidates (its `apply_top_k_top_p_pytorch`, on the
logits divided by the temperature): top-k keeps every logit not below the k-th largest (ties at the k-th stay); top-p
then runs on the top-k-renormalized probabilities in descending order and keeps a token while the mass above it is
below top_p, the largest always. Both steps keep a prefix of the candidates sorted by logit (equal logits by lower
id first), so a kept set is a count per row.

Every reduction here is elementwise or in an order fixed by the candidate count (`ordered_sum`, `inclusive_scan`):
a row's set never depends on the other rows (batch invariance).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .softmax_math import ordered_sum

# The largest kept set trainer-side replay computes unless told otherwise (prime-rl bounds top_k at 512 when it
# truncates); also the default bound on a given set's width.
DEFAULT_MAX_KEPT = 512
# Candidates fetched first for top-p without top-k: most top-p sets are far smaller; rows whose set reaches past
# them are fetched again with max_kept + 1 candidates.
FIRST_CANDIDATES = 64


class KeptPrefix(NamedTuple):
    """vLLM's rule on [R, c] candidates: `count` int64 [R] kept candidates (a prefix), `unresolved` bool [R] rows
    whose set may reach past the c candidates, `mass` fp32 [R] the full-vocabulary probability of the kept set."""

    count: Tensor
    unresolved: Tensor
    mass: Tensor


def inclusive_scan(values: Tensor) -> Tensor:
    """Cumulative sum along dim 1 of [R, c] by doubling strides (Hillis-Steele): elementwise adds in an order fixed
    by c alone. torch.cumsum's CUDA kernel picks its strategy by shape, so a row's partial sums could change with
    the row count."""
    out = values.clone()
    stride = 1
    while stride < out.shape[1]:
        out = torch.cat([out[:, :stride], out[:, stride:] + out[:, :-stride]], dim=1)
        stride *= 2
    return out


def vllm_kept_prefix(candidate_log_probs: Tensor, top_k: int, top_p: float, vocab_size: int) -> KeptPrefix:
    """How many of each row's candidates vLLM's top-k / top-p keeps.

    candidate_log_probs: fp32 [R, c] the row's c largest log-probs over the whole vocabulary at the sampling
    temperature, highest first (equal values by lower id first), -inf past the vocabulary. top_k: -1 (off) or
    >= 1; top_p: in (0, 1] (1: off)."""
    rows, c = candidate_log_probs.shape
    position = torch.arange(c, device=candidate_log_probs.device)
    finite = torch.isfinite(candidate_log_probs)
    in_top_k = finite
    if top_k > 0:
        kth = candidate_log_probs[:, min(top_k, c) - 1 : min(top_k, c)]
        in_top_k = finite & (candidate_log_probs >= kth)
    probs = torch.where(in_top_k, candidate_log_probs.exp(), torch.zeros_like(candidate_log_probs))
    kept = in_top_k
    if top_p < 1.0:
        relative = probs
        if top_k > 0:  # vLLM's top-p runs on the top-k-renormalized probabilities
            relative = probs / ordered_sum(probs.t()).unsqueeze(1)
        above = inclusive_scan(relative) - relative
        kept = in_top_k & ((above < top_p) | (position == 0))
    count = kept.sum(dim=1)
    mass = ordered_sum(torch.where(kept, probs, torch.zeros_like(probs)).t())
    more_exist = c < vocab_size
    last_kept = kept[:, -1] if c else torch.zeros(rows, dtype=torch.bool, device=kept.device)
    if top_k > 0:
        # ties at the k-th logit may continue past the candidates
        unresolved = last_kept & more_exist
    else:
        # the next candidate (not fetched) is kept while the mass above it, all of the kept mass, is below top_p
        unresolved = last_kept & (mass < top_p) & more_exist
    return KeptPrefix(count, unresolved, mass)


def padded_from_csr(token_ids: Tensor, offsets: Tensor, rows: int) -> Tensor:
    """int64 [rows, k_max] from CSR (`token_ids` [nnz], `offsets` [rows + 1]), -1 past each row's count."""
    for field, value in (("kept_csr.token_ids", token_ids), ("kept_csr.offsets", offsets)):
        if (
            not isinstance(value, Tensor)
            or value.dim() != 1
            or value.dtype.is_floating_point
            or value.dtype == torch.bool
        ):
            raise ValueError(f"{field}: expected a 1-d integer torch.Tensor")
    if offsets.numel() != rows + 1:
        raise ValueError(
            f"kept_csr.offsets: must hold rows + 1 = {rows + 1} offsets (one row per label, in labels' order), "
            f"got {offsets.numel()}"
        )
    offsets = offsets.to(device=token_ids.device, dtype=torch.int64)
    counts = offsets[1:] - offsets[:-1]
    if bool((counts < 0).any()) or int(offsets[0]) != 0 or int(offsets[-1]) != token_ids.numel():
        raise ValueError(
            f"kept_csr.offsets: must start at 0, never decrease and end at len(token_ids)={token_ids.numel()}"
        )
    width = int(counts.max()) if rows else 0
    slots = torch.arange(width, device=token_ids.device)
    inside = slots < counts.unsqueeze(1)
    gather_at = (offsets[:-1].unsqueeze(1) + slots).clamp(max=max(token_ids.numel() - 1, 0))
    picked = token_ids.long()[gather_at] if token_ids.numel() else torch.zeros_like(gather_at)
    return torch.where(inside, picked, -1)


def check_given_sets(kept: Tensor, labels: Tensor, vocab_size: int, max_kept: int, field: str) -> Tensor:
    """The label's position in each scored row's given set; ValueError naming the field and the first bad row for an
    id outside [0, vocab_size), an id twice in a row, a set wider than max_kept, or a label outside its set (the
    rollout's set must hold the token it sampled: a set that does not belongs to another token). One host read.

    kept: int64 [A, k] (-1 padding), labels: int64 [A]; field: the argument the sets came in."""
    rows, width = kept.shape
    valid = kept >= 0
    sorted_ids = kept.sort(dim=1).values
    twice = (sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)
    hits = kept == labels.unsqueeze(1)
    checks = [(kept >= vocab_size) | (kept < -1), twice, valid.sum(dim=1) > max_kept, ~hits.any(dim=1)]
    flags = torch.stack([c.any() for c in checks]).tolist() if rows else [False] * 4
    out_of_range, duplicated, too_wide, label_outside = flags
    if out_of_range:
        bad = kept[(kept >= vocab_size) | (kept < -1)][0].item()
        raise ValueError(f"{field}: ids must lie in [0, {vocab_size}) (vocab_size) or be -1 (padding), found {bad}")
    if duplicated:
        row = int(twice.any(dim=1).nonzero()[0])
        raise ValueError(f"{field}: a kept set holds each id once; scored row {row} repeats an id")
    if too_wide:
        row = int((valid.sum(dim=1) > max_kept).nonzero()[0])
        raise ValueError(
            f"{field}: scored row {row} keeps {int(valid[row].sum())} ids, more than max_kept={max_kept}; raise "
            "max_kept"
        )
    if label_outside:
        row = int((~hits.any(dim=1)).nonzero()[0]) if width else 0
        raise ValueError(
            f"{field}: scored row {row}'s label {int(labels[row])} is not in its kept set; the rollout's kept set "
            "of a token must hold the token it sampled (are the sets aligned with the labels?)"
        )
    return first_position(hits)


def first_position(hits: Tensor) -> Tensor:
    """int64 [...]: the position of the first True along the last dim of bool [..., k] (0 where none, or k = 0)."""
    if hits.shape[-1] == 0:
        return torch.zeros(hits.shape[:-1], dtype=torch.int64, device=hits.device)
    return hits.to(torch.int8).argmax(dim=-1)
