"""`replayed_log_probs`' Triton path on the CPU through Triton's interpreter (TRITON_INTERPRET=1), against fp64: the
gather-dot forward and the two backward kernels (`kept_rows_gradient_kernel`, `kept_columns_gradient_kernel`), with
given sets and sets computed in the trainer, masked rows, per-row temperatures, d_weight returned and added into a
main_grad; a row's values and d_hidden the same bits alone and inside a batch.

The named fakes of tests/test_triton_interpreter.py (fp16 for bf16, small tiles, the availability check, an in-order
`tl.dot`) are its `_interpret_on_cpu`. Tolerances: fp32 values of exact fp16 products 1e-5 absolute; gradients are
fp32 sums returned in fp16 (2^-11 rounding; 2e-4 measured): 1e-3 relative (Frobenius), into an fp16 main_grad too.
"""

from __future__ import annotations

import importlib.util

import pytest
from test_triton_interpreter import _run_interpreted as run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

VALUE_TOL, GRAD_TOL = 1e-5, 1e-3


def _interpreted_replay_cases() -> dict:
    """Run in the subprocess: each case's errors against fp64 and the batch-invariance check."""
    import torch
    from replay_reference import replayed_reference
    from test_replay import _keep_mask, _random_sets
    from test_triton_interpreter import _interpret_on_cpu

    from verl_fused_hook import replayed_log_probs

    _interpret_on_cpu()
    g = torch.Generator().manual_seed(4)
    n, h, v = 37, 72, 251  # H not a multiple of the kernels' 256 (nor the gather-dot's 128); test_replay's V
    hidden = torch.randn(n, h, generator=g).half()
    weight = (torch.randn(v, h, generator=g) * 0.3).half()
    labels = torch.randint(0, 247, (n,), generator=g)
    temperature = torch.rand(n, generator=g) + 0.5
    score_mask = torch.rand(n, generator=g) > 0.25
    active = score_mask.clone()
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    results = {}

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    for source, sets in (("given", {"kept_ids": _random_sets(labels, 9, seed=5)}), ("computed", {"top_k": 20})):
        hid, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = replayed_log_probs(
            hid, w, labels, temperature=temperature, score_mask=score_mask, vocab_size=247, backend="triton", **sets
        )
        ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()).backward()
        keep = _keep_mask(out.kept_ids)
        ref = replayed_reference(hidden.float(), weight.float(), labels, keep, temperature, active, g_lp, g_ent)
        w_fused = weight.clone().requires_grad_()
        w_fused.main_grad = torch.ones(v, h, dtype=torch.float16)
        fused = replayed_log_probs(
            hidden, w_fused, labels, temperature=temperature, score_mask=score_mask, vocab_size=247,
            backend="triton", gradient_accumulation_fusion=True, **sets,
        )  # fmt: skip
        ((fused.log_probs * g_lp).sum() + (fused.entropy * g_ent).sum()).backward()
        results[source] = {
            "log_prob": (out.log_probs.double() - ref[0]).abs().max().item(),
            "entropy": (out.entropy.double() - ref[1]).abs().max().item(),
            "d_hidden": rel(hid.grad, ref[3]),
            "d_weight": rel(w.grad, ref[4]),
            "main_grad": rel(w_fused.main_grad.float() - 1, ref[4]),
        }

    def probe(rows):
        hid = hidden[rows].clone().requires_grad_()
        out = replayed_log_probs(
            hid, weight, labels[rows], temperature=temperature[rows], top_k=20, backend="triton", vocab_size=247
        )
        (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
        return out.log_probs[-4:].detach(), out.entropy[-4:].detach(), hid.grad[-4:]

    alone = probe(torch.arange(4))
    inside = probe(torch.cat([torch.arange(4, 33), torch.arange(4)]))
    results["same_bits"] = all(torch.equal(a, b) for a, b in zip(alone, inside))
    return results


def test_replay_triton_path_in_the_interpreter():
    cases = run_interpreted("_interpreted_replay_cases", module="test_triton_replay_interpreter")
    for source in ("given", "computed"):
        case = cases[source]
        assert case["log_prob"] <= VALUE_TOL and case["entropy"] <= VALUE_TOL, (source, case)
        assert case["d_hidden"] <= GRAD_TOL and case["d_weight"] <= GRAD_TOL, (source, case)
        assert case["main_grad"] <= GRAD_TOL, (source, case)
    assert cases["same_bits"]
