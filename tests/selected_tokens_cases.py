"""`token_log_probs`'s fp64 reference and its inputs, for the CPU, interpreter, tensor-parallel and GPU tests.

The reference builds the full [N, vocab] logits in fp64 (tiny shapes only) and differentiates
sum(g_lp * log p(label) + g_ent * H + sum_j c_j log p(id_j)) with fp64 autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_fused_hook import TokenLogProbs, token_log_probs


@dataclass
class Case:
    hidden: torch.Tensor  # [N, H]
    weight: torch.Tensor  # [V_padded, H], every rank's shard concatenated
    labels: torch.Tensor  # [N]
    token_ids: torch.Tensor  # [N, k]
    vocab_size: int
    temperature: float | torch.Tensor
    score_mask: torch.Tensor | None
    g_lp: torch.Tensor  # [N] upstream gradients
    g_ent: torch.Tensor  # [N]
    g_tokens: torch.Tensor  # [N, k]


def make_case(
    n=37,
    h=24,
    padded=203,
    vocab=197,
    k=6,
    *,
    seed=0,
    per_row_temperature=True,
    masked=True,
    ignored_row=True,
    extreme=False,
    tp=1,
    dtype=torch.float32,
    device="cpu",
    weight_scale=0.5,
) -> Case:
    """Ids on every shard of `tp` (each row's first id on the last shard's first column, its second the same as
    its first: a duplicate), labels among the ids on some rows, every third row masked, ignore_index on row 1
    (`masked`, `ignored_row` False: every row scored)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(padded, h, generator=g) * weight_scale
    if extreme:  # every logit of a row offset by +-1e4 / T (the sign alternates over rows)
        hidden[:, 0] = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
        weight[:, 0] = 1.0e4
    labels = torch.randint(0, vocab, (n,), generator=g)
    token_ids = torch.randint(0, vocab, (n, k), generator=g)
    local = padded // tp
    if k:
        token_ids[:, 0] = (tp - 1) * local
    if k > 2:
        token_ids[:, 1] = token_ids[:, 0]
        token_ids[::4, 2] = labels[::4]
    if ignored_row:
        labels[1] = -100
    temperature = torch.rand(n, generator=g) + 0.5 if per_row_temperature else 0.7
    score_mask = (torch.arange(n) % 3 != 2) if masked else None
    grads = torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n, k, generator=g)
    moved = lambda t: t.to(device)  # noqa: E731
    return Case(
        moved(hidden).to(dtype),
        moved(weight).to(dtype),
        moved(labels),
        moved(token_ids),
        vocab,
        moved(temperature) if isinstance(temperature, torch.Tensor) else temperature,
        None if score_mask is None else moved(score_mask),
        *(moved(t) for t in grads),
    )


def scored_rows(case: Case) -> torch.Tensor:
    scored = case.labels != -100
    return scored if case.score_mask is None else scored & case.score_mask


def reference(case: Case, top_k: int = 0) -> dict:
    """fp64 outputs (0 / -1 on rows not computed) and gradients of hidden and the whole weight."""
    hd = case.hidden.detach().double().requires_grad_()
    wd = case.weight.detach().double().requires_grad_()
    t = case.temperature
    t = t.double().unsqueeze(1) if isinstance(t, torch.Tensor) else t
    logits = (hd @ wd[: case.vocab_size].t()) / t
    log_softmax = torch.log_softmax(logits, dim=1)
    active = scored_rows(case)
    row = active.unsqueeze(1)
    lp = torch.where(active, log_softmax.gather(1, case.labels.clamp_min(0).unsqueeze(1)).squeeze(1), 0.0)
    ent = torch.where(active, -(log_softmax.exp() * log_softmax).sum(1), 0.0)
    tok = torch.where(row, log_softmax.gather(1, case.token_ids), 0.0)
    spp = torch.where(active, (2 * log_softmax).exp().sum(1), 0.0)
    loss = (lp * case.g_lp.double()).sum() + (ent * case.g_ent.double()).sum() + (tok * case.g_tokens.double()).sum()
    loss.backward()
    out = {
        "log_probs": lp.detach(),
        "entropy": ent.detach(),
        "token_log_probs": tok.detach(),
        "sum_pi_squared": spp.detach(),
        "d_hidden": hd.grad,
        "d_weight": wd.grad,
    }
    if top_k:
        values, ids = log_softmax.detach().topk(top_k, dim=1)
        out["top_ids"] = torch.where(row, ids, -1)
        out["top_log_probs"] = torch.where(row, values, 0.0)
    return out


def upstream_loss(out, case: Case) -> torch.Tensor:
    """The scalar whose gradient the reference takes, from the op's outputs."""
    return (
        (out.log_probs * case.g_lp).sum()
        + (out.entropy * case.g_ent).sum()
        + (out.token_log_probs * case.g_tokens).sum()
    )


def run_case(
    case: Case, weight: torch.Tensor | None = None, **options
) -> tuple[TokenLogProbs, torch.Tensor, torch.Tensor]:
    """`token_log_probs` on the case (labels, ids, temperatures, mask, vocabulary) and a fresh leaf copy of its hidden
    states and weight (or `weight` as given), then backward through `upstream_loss`: (outputs, d_hidden, weight.grad).
    """
    hidden = case.hidden.clone().requires_grad_()
    weight = case.weight.clone().requires_grad_() if weight is None else weight
    out = token_log_probs(
        hidden,
        weight,
        case.labels,
        case.token_ids,
        temperature=case.temperature,
        score_mask=case.score_mask,
        vocab_size=case.vocab_size,
        **options,
    )
    upstream_loss(out, case).backward()
    return out, hidden.grad, weight.grad


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of a against the reference b."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()
