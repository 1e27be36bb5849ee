"""The op's third output (`return_label_is_max=True`) against an fp64 argmax of the full logits (CPU, torch backend)."""

import pytest
import torch
import torch.distributed as dist

from verl_fused_hook import log_probs_and_entropy
from verl_fused_hook_harness.support.distributed import run_in_processes

# Rows whose fp64 top-two logits are closer than this could flip under fp32 rounding; the inputs
# below have none, and the test checks that instead of skipping such rows silently.
MIN_GAP = 1e-4


def make_case(n=61, h=32, padded=1000, vocab=997, seed=3):
    """Half the labels are the fp64 argmax (True), the rest random (mostly False); padded columns
    past `vocab` carry the largest logits, so counting them would make every row False."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=generator)
    weight = torch.randn(padded, h, generator=generator) * 0.3
    weight[vocab:] = hidden.mean(0) * 50  # padding columns: huge logits, must leave the softmax and the max
    temperature = torch.rand(n, generator=generator) + 0.5
    logits = (hidden.double() @ weight[:vocab].double().t()) / temperature.double().unsqueeze(1)
    top2 = logits.topk(2, dim=1).values
    assert bool(((top2[:, 0] - top2[:, 1]) > MIN_GAP).all()), "inputs with near ties: pick another seed"
    argmax = logits.argmax(dim=1)
    labels = torch.randint(0, vocab, (n,), generator=generator)
    labels[::2] = argmax[::2]
    score_mask = torch.arange(n) % 5 != 4
    want = (labels == argmax) & score_mask
    return hidden, weight, labels, vocab, temperature, score_mask, want


def test_label_is_max_matches_fp64_argmax():
    hidden, weight, labels, vocab, temperature, score_mask, want = make_case()
    hidden.requires_grad_(True)
    log_probs, entropy, label_is_max = log_probs_and_entropy(
        hidden,
        weight,
        labels,
        temperature=temperature,
        score_mask=score_mask,
        vocab_size=vocab,
        backend="torch",
        tile_rows=8,
        return_label_is_max=True,
    )
    assert label_is_max.dtype == torch.bool and label_is_max.shape == labels.shape
    assert not label_is_max.requires_grad
    assert torch.equal(label_is_max, want)
    assert 0 < int(want.sum()) < int(score_mask.sum())  # both outcomes are exercised
    # The other outputs and their gradient are those of the two-output call.
    plain_lp, plain_ent = log_probs_and_entropy(
        hidden,
        weight,
        labels,
        temperature=temperature,
        score_mask=score_mask,
        vocab_size=vocab,
        backend="torch",
        tile_rows=8,
    )
    assert torch.equal(log_probs, plain_lp) and torch.equal(entropy, plain_ent)
    log_probs.sum().backward()
    assert hidden.grad is not None and torch.isfinite(hidden.grad).all()


def test_label_is_max_without_grad_and_entropy():
    hidden, weight, labels, vocab, temperature, score_mask, want = make_case(seed=5)
    with torch.no_grad():
        _, entropy, label_is_max = log_probs_and_entropy(
            hidden,
            weight,
            labels,
            temperature=temperature,
            score_mask=score_mask,
            vocab_size=vocab,
            calculate_entropy=False,
            backend="torch",
            return_label_is_max=True,
        )
    assert entropy is None
    assert torch.equal(label_is_max, want)


def test_exact_tie_counts_as_label_is_max():
    """Two identical weight rows give bit-equal logits: both tied labels count as the max (megatron's
    argmax would accept only the lower id)."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(4, 16, generator=generator)
    weight = torch.randn(50, 16, generator=generator) * 0.1
    weight[7] = weight[30] = hidden.sum(0)  # the largest logit of every row, twice
    labels = torch.tensor([7, 30, 3, 30])
    _, _, label_is_max = log_probs_and_entropy(hidden, weight, labels, backend="torch", return_label_is_max=True)
    assert label_is_max.tolist() == [True, True, False, True]
    assert torch.argmax(hidden @ weight.t(), dim=1).tolist() == [7, 7, 7, 7]


def test_return_label_is_max_must_be_bool():
    hidden, weight, labels, *_ = make_case()
    with pytest.raises(ValueError, match="return_label_is_max"):
        log_probs_and_entropy(hidden, weight, labels, backend="torch", return_label_is_max=1)


def sharded_worker(rank, world_size):
    hidden, weight, labels, vocab, temperature, score_mask, _ = make_case()
    shard = weight.chunk(world_size)[rank]
    *_, label_is_max = log_probs_and_entropy(
        hidden,
        shard,
        labels,
        temperature=temperature,
        tp_group=dist.group.WORLD,
        score_mask=score_mask,
        vocab_size=vocab,
        backend="torch",
        tile_rows=16,
        return_label_is_max=True,
    )
    return label_is_max


@pytest.mark.parametrize("world_size", [2, 4])
def test_label_is_max_over_tensor_parallel_ranks(world_size):
    *_, want = make_case()
    for label_is_max in run_in_processes(sharded_worker, world_size):
        assert torch.equal(label_is_max, want)
