"""The bench's distillation methods (commands/bench/distill.py) at a tiny shape on the CPU: ours (portable backend),
verl's
megatron path and verl's use_chunked_topk path give the same loss and gradients (fp32 inputs, so verl's logits are
fp32 here: 1e-5 relative), each method's accuracy check runs, and the report names where a method ran out of memory.
No timing."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from verl_fused_hook_harness.commands.bench import distill as bench_distill  # noqa: E402
from verl_fused_hook_harness.commands.bench.report import markdown  # noqa: E402

N, H, V, K = 24, 16, 300, 8


def _inputs():
    g = torch.Generator().manual_seed(5)
    return torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.5, torch.randint(0, V, (N,), generator=g)


def test_methods_agree_on_the_cpu():
    hidden, weight, labels = _inputs()
    results = {}
    for name, load in bench_distill.loaders(K).items():
        fn = load()
        assert not isinstance(fn, str), fn
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if getattr(fn, "returns_loss", False):
            loss = fn(h, w, labels, 0.7)
            results[name] = (loss.detach(), *torch.autograd.grad(loss, (h, w)))
            accuracy = fn.accuracy(hidden, weight, labels, 0.7)
            assert accuracy["loss_rel_err"] <= 1e-5 and accuracy["d_hidden_rel_err"] <= 1e-5, (name, accuracy)
        else:
            log_probs, entropy = fn(h, w, labels, 0.7)
            assert log_probs.shape == (N,) and entropy.shape == (N,)
    ours = results["kl_topk"]
    for name in ("verl_kl_topk", "verl_kl_topk_chunked"):
        for mine, theirs in zip(ours, results[name]):
            assert ((mine - theirs).norm() / theirs.norm()).item() <= 1e-5, name


def test_chunk_budget_reaches_the_op():
    """--top-k-chunk-bytes goes to token_log_probs: a budget it refuses is refused by name."""
    hidden, weight, labels = _inputs()
    fn = bench_distill.loaders(K, chunk_bytes=0)["kl_topk"]()
    with pytest.raises(ValueError, match="top_k_chunk_bytes"):
        fn(hidden, weight, labels, 0.7)
    one = bench_distill.loaders(K, chunk_bytes=1 << 20)["kl_topk"]()(hidden, weight, labels, 0.7)
    assert torch.equal(one, bench_distill.loaders(K)["kl_topk"]()(hidden, weight, labels, 0.7))


def test_overlap_metrics_match_verls_comparison():
    g = torch.Generator().manual_seed(2)
    teacher = torch.randint(0, 20, (50, 6), generator=g)
    student = torch.stack([torch.randperm(20, generator=g)[:6] for _ in range(50)])
    kl = torch.randn(50, 6, generator=g)
    count, advantage = bench_distill.overlap_metrics(teacher, student, kl)
    mask = (teacher.unsqueeze(-1) == student.unsqueeze(-2)).any(-1)
    want = (-kl * mask).sum(-1) / mask.sum(-1).clamp_min(1)
    assert torch.equal(count, mask.sum(-1)) and torch.allclose(advantage, want)


def test_report_says_where_a_method_ran_out_of_memory():
    def row(n, verl):
        return {
            "N": n,
            "H": 4096,
            "V": 151936,
            "kl_topk": {"fwd_bwd_ms": 10.0},
            "verl_kl_topk": {"fwd_bwd_ms": verl},
        }

    results = {
        "methods": ["kl_topk", "verl_kl_topk"],
        "topk": 128,
        "shapes": [row(16384, 12.0), row(65536, "out of memory: tried"), row(131072, "out of memory: tried")],
    }
    table = markdown(results)
    assert "- verl_kl_topk: OOM at N=65536, 131072" in table and "top-128" in table
