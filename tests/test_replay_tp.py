"""`replayed_log_probs` with the vocabulary sharded over two gloo processes, against fp64 over the whole vocabulary:
kept ids on either shard (and sets spanning both), a padded vocabulary, per-row temperatures and masked rows; hidden
replicated and sequence-sharded; given sets and sets computed in the trainer; under batch_invariant the values have
the bits of one rank's run. Tolerances as tests/test_replay.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from replay_reference import replayed_reference
from test_replay import VALUE_TOL, _case, _keep_mask, _max_abs, _random_sets, _rel

from verl_fused_hook import replayed_log_probs
from verl_fused_hook_harness.support.distributed import run_in_processes
from verl_fused_hook_harness.support.truncated_sampling import vllm_keep_mask

WORLD = 2
GRAD_TOL = 1e-5
ROWS = 40  # divisible by WORLD for the sequence-sharded layout


def _sets(labels):
    kept = _random_sets(labels.clamp_min(0), 8, seed=21)
    return {"given": {"kept_ids": kept}, "computed": {"top_k": 30, "top_p": 0.85, "backend": "torch"}}


def worker(rank, world_size):
    hidden, weight, labels, temperature, score_mask = _case(n=ROWS, seed=20)
    shard_rows = weight.shape[0] // world_size + 1  # 126 columns each: rank 1's shard ends in padding
    padded = torch.cat([weight, weight.new_zeros(shard_rows * world_size - weight.shape[0], weight.shape[1])])
    results = {}
    for source, sets in _sets(labels).items():
        for layout in ("replicated", "sequence_sharded"):
            for invariant in (False, True):
                shard = padded.chunk(world_size)[rank].clone().requires_grad_()
                hid = hidden.clone()
                if layout == "sequence_sharded":
                    hid = hid.chunk(world_size)[rank].clone()
                hid.requires_grad_()
                out = replayed_log_probs(
                    hid, shard, labels, temperature=temperature, score_mask=score_mask, vocab_size=247,
                    tp_group=dist.group.WORLD, tp_hidden=layout, batch_invariant=invariant, chunk_rows=8, **sets,
                )  # fmt: skip
                (out.log_probs * torch.linspace(-1, 1, ROWS) + 0.5 * out.entropy).sum().backward()
                results[(source, layout, invariant)] = (
                    out.log_probs.detach(),
                    out.entropy.detach(),
                    out.kept_ids,
                    hid.grad,
                    shard.grad,
                )
    return results


@pytest.fixture(scope="module")
def rank_results():
    return run_in_processes(worker, WORLD)


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("layout", ["replicated", "sequence_sharded"])
@pytest.mark.parametrize("source", ["given", "computed"])
def test_ranks_match_fp64_and_each_other(source, layout, invariant, rank_results):
    hidden, weight, labels, temperature, score_mask = _case(n=ROWS, seed=20)
    active = score_mask & (labels >= 0)
    per_rank = [r[(source, layout, invariant)] for r in rank_results]
    kept = per_rank[0][2]
    for other in per_rank[1:]:  # every rank returns the same values and sets
        assert all(torch.equal(a, b) for a, b in zip(per_rank[0][:3], other[:3]))
    if source == "given":
        keep = _keep_mask(_random_sets(labels.clamp_min(0), 8, seed=21))
    else:
        logits = hidden.double() @ weight.double().t()
        logits[:, 247:] = float("-inf")
        keep = vllm_keep_mask(logits, temperature, 30, 0.85) | _keep_mask(kept)  # plus any label added
        for r in torch.nonzero(active).squeeze(1).tolist():
            found = set(kept[r][kept[r] >= 0].tolist())
            assert found == set(torch.nonzero(keep[r]).squeeze(1).tolist())
    g_lp, g_ent = torch.linspace(-1, 1, ROWS), torch.full((ROWS,), 0.5)
    ref = replayed_reference(hidden, weight, labels, keep, temperature, active, g_lp, g_ent)
    assert _max_abs(per_rank[0][0], ref[0]) <= VALUE_TOL and _max_abs(per_rank[0][1], ref[1]) <= VALUE_TOL
    d_weight = torch.cat([r[4] for r in per_rank])[: weight.shape[0]]
    assert _rel(d_weight, ref[4]) <= GRAD_TOL
    if layout == "replicated":
        assert all(_rel(r[3], ref[3]) <= GRAD_TOL for r in per_rank)
    else:
        assert _rel(torch.cat([r[3] for r in per_rank]), ref[3]) <= GRAD_TOL
    if invariant:  # the bits of one rank's run over the whole vocabulary
        sets = _sets(labels)[source]
        one = replayed_log_probs(
            hidden, weight, labels, temperature=temperature, score_mask=score_mask, vocab_size=247,
            batch_invariant=True, **sets,
        )  # fmt: skip
        assert torch.equal(one.log_probs, per_rank[0][0]) and torch.equal(one.entropy, per_rank[0][1])
