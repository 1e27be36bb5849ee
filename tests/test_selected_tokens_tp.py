"""`token_log_probs` with the vocabulary sharded over two gloo processes, against the fp64 reference of the whole
vocabulary: ids on the other rank's shard (every row's first id sits on the last shard), a padded vocabulary, per-row
temperatures and masked rows; hidden replicated and sequence-sharded; a few rows alone bitwise as in the batch.
Tolerances as tests/test_selected_tokens.py's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from selected_tokens_cases import make_case, max_abs, reference, rel, upstream_loss

from verl_fused_hook import token_log_probs
from verl_fused_hook_harness.support.distributed import run_in_processes

WORLD = 2
VALUE_TOL = 1e-5
GRAD_TOL = 1e-5
TOP_K = 5


def _case():
    return make_case(n=38, padded=202, vocab=197, k=7, tp=WORLD)


def worker(rank, world_size):
    results = {}
    for layout in ("replicated", "sequence_sharded"):
        case = _case()
        shard = case.weight.chunk(world_size)[rank].clone().requires_grad_()
        hidden = case.hidden.clone()
        if layout == "sequence_sharded":
            hidden = hidden.chunk(world_size)[rank].clone()
        hidden.requires_grad_()
        out = token_log_probs(
            hidden,
            shard,
            case.labels,
            case.token_ids,
            temperature=case.temperature,
            tp_group=dist.group.WORLD,
            tp_hidden=layout,
            score_mask=case.score_mask,
            vocab_size=case.vocab_size,
            top_k=TOP_K,
            calculate_sum_pi_squared=True,
            backend="torch",
            tile_rows=8,
        )
        upstream_loss(out, case).backward()
        results[layout] = (out._asdict(), hidden.grad, shard.grad)
    case = _case()  # rows 10..12 alone: bitwise the batch's rows (batch invariance under TP)
    shard = case.weight.chunk(world_size)[rank]
    rows = slice(10, 13)
    alone = token_log_probs(
        case.hidden[rows],
        shard,
        case.labels[rows],
        case.token_ids[rows],
        temperature=case.temperature[rows],
        tp_group=dist.group.WORLD,
        vocab_size=case.vocab_size,
        top_k=TOP_K,
        calculate_sum_pi_squared=True,
        backend="torch",
        tile_rows=8,
    )
    everything = token_log_probs(
        case.hidden,
        shard,
        case.labels,
        case.token_ids,
        temperature=case.temperature,
        tp_group=dist.group.WORLD,
        vocab_size=case.vocab_size,
        top_k=TOP_K,
        calculate_sum_pi_squared=True,
        backend="torch",
        tile_rows=8,
    )
    results["invariant"] = all(
        torch.equal(value, getattr(everything, name)[rows]) for name, value in alone._asdict().items()
    )
    return results


@pytest.fixture(scope="module")
def rank_results():
    return run_in_processes(worker, WORLD)


@pytest.mark.parametrize("layout", ["replicated", "sequence_sharded"])
def test_ranks_match_fp64_reference(layout, rank_results):
    case = _case()
    want = reference(case, top_k=TOP_K)
    outputs, d_hiddens, d_weights = zip(*(per_rank[layout] for per_rank in rank_results))
    for name, value in outputs[0].items():
        assert all(torch.equal(other[name], value) for other in outputs[1:]), f"ranks must agree on {name}"
        if name == "top_ids":
            assert torch.equal(value, want[name])
        else:
            assert max_abs(value, want[name]) <= VALUE_TOL, name
    assert rel(torch.cat(d_weights), want["d_weight"]) <= GRAD_TOL
    if layout == "replicated":  # each rank holds the complete d_hidden
        for d_hidden in d_hiddens:
            assert rel(d_hidden, want["d_hidden"]) <= GRAD_TOL
    else:  # each rank holds its slice's
        assert rel(torch.cat(d_hiddens), want["d_hidden"]) <= GRAD_TOL


def test_a_rows_outputs_do_not_depend_on_the_batch(rank_results):
    assert all(per_rank["invariant"] for per_rank in rank_results)
