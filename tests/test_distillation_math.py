"""Hook mode's forward_kl_topk (verl_integration/distillation.py) against verl's `_VocabParallelKLDivergence` on the
same logits, the clamp's gradient at equality included (one gloo process: verl's function reads megatron's TP
group).

verl's backward gives no gradient to a teacher entry whose student log-prob equals `log_prob_min_clamp` (its
active mask is a strict `>`; torch 2.14's `clamp_min` agrees, `torch.maximum` would split it, a `>=` pass it). A
row of equal logits puts every entry exactly at log(1/V) in both computations; the clamp there must leave the row
without gradient, as verl's does.
"""

from __future__ import annotations

import math

import torch

from verl_fused_hook_harness.support.distributed import run_in_processes

N, V, K = 6, 64, 5


def _inputs():
    generator = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(N, V, generator=generator)
    logits[0] = 0.0  # every entry of row 0 at log(1/V): exactly the clamp below
    ids = torch.stack([torch.randperm(V, generator=generator)[:K] for _ in range(N)])
    ids[::2, -1] = ids[::2, 0]  # repeated ids
    teacher = torch.log_softmax(2 * torch.randn(N, K + 3, generator=generator), -1).sort(-1, descending=True)
    upstream = torch.randn(N, generator=generator)
    return logits, ids, teacher.values[:, :K], upstream


def _both(rank, world_size, non_strict=False) -> dict:
    from verl.trainer.distillation.megatron.losses import _VocabParallelKLDivergence

    from verl_fused_hook.verl_integration.distillation import TOPK_OUTPUT_KEYS, forward_kl_topk
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel

    init_model_parallel(1, seed=0)
    logits, ids, teacher, upstream = _inputs()
    clamp = float(torch.log_softmax(logits[0], -1)[0])  # log(1/V) as fp32 computes it
    assert clamp == -math.log(V) or abs(clamp + math.log(V)) < 1e-6

    verl_logits = logits.clone().unsqueeze(0).requires_grad_()
    verl = _VocabParallelKLDivergence.apply(verl_logits, teacher.unsqueeze(0), ids.unsqueeze(0), clamp)
    (verl[0][0] * upstream).sum().backward()

    ours_logits = logits.clone().requires_grad_()
    log_softmax = torch.log_softmax(ours_logits, -1)
    student = log_softmax.gather(-1, ids)
    assert bool((student[0] == clamp).all())  # the equality case, in both computations
    clamp_for_ours = clamp
    if non_strict:  # a clamp that passes the gradient at equality
        student = torch.where(student >= clamp, student, torch.full_like(student, clamp))
        clamp_for_ours = None
    top_ids = log_softmax.topk(K, dim=-1).indices
    ours = forward_kl_topk(student, top_ids, ids, teacher, clamp_for_ours, None)
    (ours["distillation_losses"] * upstream).sum().backward()
    return {
        "verl": {key: value[0].detach() for key, value in zip(TOPK_OUTPUT_KEYS, verl)},
        "ours": {key: value.detach() for key, value in ours.items()},
        "verl_grad": verl_logits.grad[0],
        "ours_grad": ours_logits.grad,
    }


def test_forward_kl_topk_equals_verls_including_the_clamp_at_equality():
    (result,) = run_in_processes(_both, 1)
    for key, want in result["verl"].items():
        got = result["ours"][key]
        assert got.dtype == want.dtype, key
        assert torch.allclose(got.double(), want.double(), rtol=1e-6, atol=1e-6), (key, got, want)
    assert torch.allclose(result["ours_grad"], result["verl_grad"], rtol=1e-5, atol=1e-7)
    assert bool((result["verl_grad"][0] == 0).all()) and bool((result["ours_grad"][0] == 0).all())
    assert bool((result["verl_grad"][1:] != 0).any())


def test_a_clamp_passing_the_gradient_at_equality_would_differ():
    """The test above is sensitive to the rule at equality."""
    (result,) = run_in_processes(_both, 1, True)
    assert bool((result["ours_grad"][0] != 0).any())
