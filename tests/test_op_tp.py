"""The op with a vocabulary sharded over two and four gloo processes, against the fp64 reference of the whole
vocabulary."""

import pytest
import torch
import torch.distributed as dist

from verl_fused_hook import log_probs_and_entropy
from verl_fused_hook_harness.support import compare
from verl_fused_hook_harness.support.distributed import run_in_processes
from verl_fused_hook_harness.support.reference import reference_log_probs_entropy

ATOL = 5e-5  # log-prob / entropy (entropy sums up to 32k columns in fp32)
GRAD_RTOL = 1e-5


def case_inputs(case, world_size):
    generator = torch.Generator().manual_seed(11)
    n, h = 41, 24
    padded_32003 = -(-32003 // world_size) * world_size  # Megatron pads the vocabulary to a multiple of TP
    padded, vocab = {
        "padded_32003": (padded_32003, 32003),
        "single_column": (world_size, world_size),  # one column per rank
        "labels_on_one_rank": (600, 600),
    }[case]
    hidden = torch.randn(n, h, generator=generator)
    weight = torch.randn(padded, h, generator=generator) * 0.3
    labels = torch.randint(0, vocab, (n,), generator=generator)
    if case == "labels_on_one_rank":
        labels = labels % (padded // world_size)  # only rank 0's shard holds labels
    temperature = torch.rand(n, generator=generator) + 0.5 if case == "padded_32003" else 0.7
    score_mask = torch.arange(n) % 3 != 1
    grads = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    return hidden, weight, labels, vocab, temperature, score_mask, grads


CASES = ("padded_32003", "single_column", "labels_on_one_rank")


def all_cases_worker(rank, world_size):
    """Every case in one spawn (process start-up dominates the cost)."""
    results = {case: shard_worker(rank, world_size, case, False) for case in CASES}
    results["masked"] = shard_worker(rank, world_size, "padded_32003", True)
    results["no_grad"] = no_grad_worker(rank, world_size)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def rank_results(request):
    return request.param, run_in_processes(all_cases_worker, request.param)


def shard_worker(rank, world_size, case, mask_everything):
    hidden, weight, labels, vocab, temperature, score_mask, grads = case_inputs(case, world_size)
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
        tp_hidden="partial",  # each rank's own shard's d_hidden: summed below
        score_mask=score_mask,
        vocab_size=vocab,
        backend="torch",
        tile_rows=8,
    )
    (log_probs * grads[0] + entropy * grads[1]).sum().backward()
    return log_probs, entropy, hidden.grad, shard.grad


def _labels_some_ignored(world_size):
    labels = case_inputs("padded_32003", world_size)[2].clone()
    labels[::5] = -100
    return labels


def no_grad_worker(rank, world_size):
    """Without gradients the op reads the labels after its kernels and takes a host mask's rows on the host; rows
    labelled ignore_index are then computed and zeroed: (that call's outputs, the same call with gradients)."""
    hidden, weight, _, vocab, temperature, score_mask, _ = case_inputs("padded_32003", world_size)
    labels = _labels_some_ignored(world_size)
    shard = weight.chunk(world_size)[rank]
    call = dict(
        temperature=temperature, tp_group=dist.group.WORLD, tp_hidden="partial", score_mask=score_mask,
        vocab_size=vocab, backend="torch", tile_rows=8,
    )  # fmt: skip
    with torch.no_grad():
        checked_after = log_probs_and_entropy(hidden, shard, labels, **call)
    checked_first = log_probs_and_entropy(hidden.clone().requires_grad_(True), shard, labels, **call)
    return checked_after, tuple(t.detach() for t in checked_first)


def test_ranks_without_gradients_read_the_labels_after_the_kernels(rank_results):
    """The same bits on every rank and as the call that checks the labels first (the torch backend on the CPU is
    batch invariant, the ranks' partials merge in rank order); 0 at rows labelled ignore_index."""
    world_size, results = rank_results
    ignored = _labels_some_ignored(world_size) == -100
    rank0_after = results[0]["no_grad"][0]
    for per_rank in results:
        checked_after, checked_first = per_rank["no_grad"]
        for after, first, rank0 in zip(checked_after, checked_first, rank0_after, strict=True):
            assert torch.equal(after, first) and torch.equal(after, rank0)
            assert torch.all(after[ignored] == 0)


@pytest.mark.parametrize("case", CASES)
def test_ranks_match_fp64_reference(case, rank_results):
    world_size, results = rank_results
    results = [per_rank[case] for per_rank in results]
    hidden, weight, labels, vocab, temperature, score_mask, grads = case_inputs(case, world_size)
    want_lp, want_ent, want_dh, want_dw = reference_log_probs_entropy(
        hidden, weight, labels, temperature=temperature, vocab_size=vocab, active=score_mask, grad_outputs=grads
    )
    log_probs, entropies, d_hiddens, d_weights = zip(*results)
    for rank in range(1, world_size):
        assert torch.equal(log_probs[rank], log_probs[0]) and torch.equal(entropies[rank], entropies[0]), (
            "ranks must agree"
        )
    assert compare.max_abs(log_probs[0], want_lp) <= ATOL and compare.max_abs(entropies[0], want_ent) <= ATOL
    # Each rank returns its partial d_hidden; their sum is the full gradient.
    assert compare.error(want_dh, sum(d_hiddens), relative=True) <= GRAD_RTOL
    assert compare.error(want_dw, torch.cat(d_weights), relative=True) <= GRAD_RTOL


def test_ranks_with_every_row_masked(rank_results):
    _, results = rank_results
    for per_rank in results:
        for tensor in per_rank["masked"]:
            assert torch.count_nonzero(tensor) == 0
