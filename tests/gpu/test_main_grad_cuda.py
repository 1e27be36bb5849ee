"""gradient_accumulation_fusion on the Triton backend against fp64 (CUDA; skipped elsewhere).

d_weight added into an fp32 `main_grad` (as megatron's DDP gives every parameter) over several groups of rows,
each walking the whole vocabulary (triton_recompute.row_groups with the sum in place): log-probs, entropy and
d_hidden as without it, d_weight without its bf16 rounding, and the backward's working memory one group's walk.
The `main_grad` / `grad_added_to_main_grad` attributes set here are the ones megatron's DDP sets.
"""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook.ops import log_probs_and_entropy
from verl_fused_hook_harness.support.reference import max_abs, reference_log_probs_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VALUE_TOL = 5e-5
GRAD_TOL = 2.5e-3  # relative (Frobenius) against fp64, bf16 inputs
N, H, V, TRUE_VOCAB = 60000, 512, 16000, 15990


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(71)
    hidden = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) * H**-0.5 * 2).bfloat16()
    labels = torch.randint(0, TRUE_VOCAB, (N,), device="cuda", generator=g)
    score_mask = torch.rand(N, device="cuda", generator=g) > 0.1
    g_lp, g_ent = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)
    return hidden, weight, labels, score_mask, g_lp, g_ent


def _step(hidden, weight, labels, score_mask, g_lp, g_ent, fusion):
    h = hidden.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(h, weight, labels, temperature=0.8, score_mask=score_mask, vocab_size=TRUE_VOCAB,
                                    backend="triton", gradient_accumulation_fusion=fusion)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp, ent, h.grad


def test_groups_of_rows_add_into_fp32_main_grad():
    from verl_fused_hook.ops import triton_recompute

    hidden, weight, labels, score_mask, g_lp, g_ent = _inputs()
    scored = int(score_mask.sum())
    assert len(triton_recompute.row_groups(scored, H, TRUE_VOCAB, True, True, True)) >= 2
    assert len(triton_recompute.row_groups(scored, H, TRUE_VOCAB, True, True)) == 1

    plain = weight.clone().requires_grad_()
    lp0, ent0, d_hidden0 = _step(hidden, plain, labels, score_mask, g_lp, g_ent, False)
    fused = weight.clone().requires_grad_()
    fused.main_grad = torch.full(weight.shape, 0.5, device="cuda")  # an earlier micro-batch's sum
    fused.grad_added_to_main_grad = False
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent, d_hidden = _step(hidden, fused, labels, score_mask, g_lp, g_ent, True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert fused.grad_added_to_main_grad is True

    ref = reference_log_probs_entropy(hidden, weight, labels, temperature=0.8, vocab_size=TRUE_VOCAB,
                                      active=score_mask, grad_outputs=(g_lp, g_ent))
    assert max_abs(lp, ref[0]) <= VALUE_TOL and max_abs(ent, ref[1]) <= VALUE_TOL
    assert torch.equal(lp, lp0) and torch.equal(ent, ent0)
    errors = {"d_hidden": _rel(d_hidden, ref[2]), "d_hidden_returned": _rel(d_hidden0, ref[2]),
              "d_weight": _rel(fused.main_grad.double() - 0.5, ref[3]), "d_weight_returned": _rel(plain.grad, ref[3])}
    assert errors["d_hidden"] <= GRAD_TOL and errors["d_hidden"] <= 1.01 * errors["d_hidden_returned"], errors
    # no bf16 rounding of d_weight
    assert errors["d_weight"] <= GRAD_TOL and errors["d_weight"] < errors["d_weight_returned"], errors
    assert bool((fused.main_grad[TRUE_VOCAB:] == 0.5).all())
    # beyond the outputs (h's copy, its bf16 d_hidden, the placeholder gradient) and what the forward saves (the
    # scored rows' compacted copy, per-row statistics): one group's walk
    returned = 2 * N * H + 2 * N * H + 2 * V * H
    saved = 2 * scored * H + 32 * 1024**2
    assert peak - returned - saved <= triton_recompute.IN_PLACE_WALK_BYTES, (peak - returned - saved) / 1024**2


def test_verl_backend_refuses_it():
    pytest.importorskip("verl")
    hidden, weight, labels, *_ = _inputs()
    w = weight.clone().requires_grad_()
    w.main_grad = torch.zeros(weight.shape, device="cuda")
    with pytest.raises(ValueError, match="backend 'verl'"):
        log_probs_and_entropy(hidden[:64], w, labels[:64], backend="verl", gradient_accumulation_fusion=True)
