"""The op with a vocabulary sharded over two gloo processes, against the fp64 reference of the whole vocabulary."""

import pytest
import torch
import torch.distributed as dist
from reference import max_abs, max_rel, reference_log_probs_entropy

from verl_fused_hook import log_probs_and_entropy
from verl_fused_hook.testing.distributed import run_on_gloo

ATOL = 5e-5  # log-prob / entropy (entropy sums up to 32k columns in fp32)
GRAD_RTOL = 1e-5


def case_inputs(case):
    generator = torch.Generator().manual_seed(11)
    n, h = 41, 24
    padded, vocab = {"padded_32003": (32004, 32003), "single_column": (2, 2), "labels_on_one_rank": (600, 600)}[case]
    hidden = torch.randn(n, h, generator=generator)
    weight = torch.randn(padded, h, generator=generator) * 0.3
    labels = torch.randint(0, vocab, (n,), generator=generator)
    if case == "labels_on_one_rank":
        labels = labels % (padded // 2)  # rank 1's shard holds no label at all
    temperature = torch.rand(n, generator=generator) + 0.5 if case == "padded_32003" else 0.7
    score_mask = torch.arange(n) % 3 != 1
    grads = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    return hidden, weight, labels, vocab, temperature, score_mask, grads


CASES = ("padded_32003", "single_column", "labels_on_one_rank")


def all_cases_worker(rank, world_size):
    """Every case in one spawn (process start-up dominates the cost)."""
    results = {case: shard_worker(rank, world_size, case, False) for case in CASES}
    results["masked"] = shard_worker(rank, world_size, "padded_32003", True)
    return results


@pytest.fixture(scope="module")
def two_rank_results():
    return run_on_gloo(all_cases_worker, 2)


def shard_worker(rank, world_size, case, mask_everything):
    hidden, weight, labels, vocab, temperature, score_mask, grads = case_inputs(case)
    if mask_everything:
        score_mask = torch.zeros_like(score_mask)
    shard = weight.chunk(world_size)[rank].clone().requires_grad_(True)
    hidden = hidden.clone().requires_grad_(True)
    log_probs, entropy = log_probs_and_entropy(
        hidden,
        shard,
        labels,
        temperature=temperature,
        tp_group=dist.group.WORLD,
        score_mask=score_mask,
        vocab_size=vocab,
        backend="torch",
        tile_rows=8,
    )
    (log_probs * grads[0] + entropy * grads[1]).sum().backward()
    return log_probs, entropy, hidden.grad, shard.grad


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_match_fp64_reference(case, two_rank_results):
    results = [rank_results[case] for rank_results in two_rank_results]
    hidden, weight, labels, vocab, temperature, score_mask, grads = case_inputs(case)
    want_lp, want_ent, want_dh, want_dw = reference_log_probs_entropy(
        hidden, weight, labels, temperature=temperature, vocab_size=vocab, active=score_mask, grad_outputs=grads
    )
    (lp0, ent0, dh0, dw0), (lp1, ent1, dh1, dw1) = results
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1), "ranks must return identical outputs"
    assert max_abs(lp0, want_lp) <= ATOL and max_abs(ent0, want_ent) <= ATOL
    # Each rank returns its partial d_hidden; their sum is the full gradient.
    assert max_rel(dh0 + dh1, want_dh) <= GRAD_RTOL
    assert max_rel(torch.cat([dw0, dw1])[: weight.shape[0]], torch.cat([want_dw])) <= GRAD_RTOL


def test_two_ranks_with_every_row_masked(two_rank_results):
    (lp0, ent0, dh0, dw0), (lp1, ent1, dh1, dw1) = [rank_results["masked"] for rank_results in two_rank_results]
    for tensor in (lp0, ent0, dh0, dw0, lp1, ent1, dh1, dw1):
        assert torch.count_nonzero(tensor) == 0
