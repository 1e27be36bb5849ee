"""`tp_hidden`: the op completes d_hidden under tensor parallelism (two gloo processes, CPU, torch backend).

Against the fp64 reference of the whole vocabulary (tests/reference.py): "replicated" gives every rank
the full d_hidden, "sequence_sharded" gives each rank the d_hidden of its slice of dim 0, "partial"
gives each rank its shard's part (their sum is the full one). Against megatron-core's own mappings
(copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region with
tensor_parallel_output_grad=True) followed by the op with "partial": the same bits.
"""

import pytest
import torch
import torch.distributed as dist

from verl_fused_hook.ops import TP_HIDDEN_CHOICES, log_probs_and_entropy, log_probs_entropy_and_loss
from verl_fused_hook_harness.support import compare
from verl_fused_hook_harness.support.distributed import run_in_processes
from verl_fused_hook_harness.support.reference import reference_log_probs_entropy

ATOL = 1e-5  # log-prob / entropy, fp32
GRAD_RTOL = 1e-5  # gradients, relative to the reference's largest entry
S, B, H, PADDED, VOCAB = 12, 3, 16, 1000, 997  # two shards of 500 columns, the last 3 padding


def case_inputs():
    """hidden [s, b, h] (Megatron's layout); labels, temperature, score mask and upstream gradients [s, b]."""
    g = torch.Generator().manual_seed(21)
    hidden = torch.randn(S, B, H, generator=g)
    weight = torch.randn(PADDED, H, generator=g) * 0.3
    labels = torch.randint(0, VOCAB, (S, B), generator=g)
    temperature = torch.rand(S, B, generator=g) + 0.5
    score_mask = torch.rand(S, B, generator=g) > 0.25
    grads = torch.randn(S, B, generator=g), torch.randn(S, B, generator=g)
    return hidden, weight, labels, temperature, score_mask, grads


def reference():
    hidden, weight, labels, temperature, score_mask, grads = case_inputs()
    lp, ent, dh, dw = reference_log_probs_entropy(
        hidden.reshape(-1, H),
        weight,
        labels.reshape(-1),
        temperature=temperature.reshape(-1),
        vocab_size=VOCAB,
        active=score_mask.reshape(-1),
        grad_outputs=tuple(g.reshape(-1) for g in grads),
    )
    return lp.view(S, B), ent.view(S, B), dh.view(S, B, H), dw


def _op(rank, world_size, tp_hidden, *, sliced=None, map_hidden=None, fused_loss=False):
    """One rank's outputs and gradients. The rank holds all of hidden, or its slice of dim 0 (`sliced`, by
    default for "sequence_sharded"); `map_hidden` (megatron's mapping) runs on it before the op."""
    full, weight, labels, temperature, score_mask, grads = case_inputs()
    shard = weight.chunk(world_size)[rank].clone().requires_grad_(True)
    rows = S // world_size
    sliced = tp_hidden == "sequence_sharded" if sliced is None else sliced
    leaf = (full[rank * rows : (rank + 1) * rows] if sliced else full).clone().requires_grad_(True)
    hidden = leaf if map_hidden is None else map_hidden(leaf)
    common = dict(
        temperature=temperature, tp_group=dist.group.WORLD, tp_hidden=tp_hidden, score_mask=score_mask, vocab_size=VOCAB
    )
    if fused_loss:
        result = log_probs_entropy_and_loss(
            hidden,
            shard,
            labels,
            **common,
            chunk_rows=7,
            loss_fn=lambda lp, ent: ((lp * grads[0]).sum() + (ent * grads[1]).sum(), {}),
            loss_name="weighted sum",
        )
        result.loss.backward()
        log_probs, entropy = result.log_probs, result.entropy
    else:
        log_probs, entropy = log_probs_and_entropy(hidden, shard, labels, **common, backend="torch", tile_rows=8)
        (log_probs * grads[0] + entropy * grads[1]).sum().backward()
    return log_probs.detach(), entropy.detach(), leaf.grad, shard.grad


def _through_megatron(rank, world_size, sequence_parallel: bool):
    """megatron's own mapping of hidden, then the op with "partial"."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    from verl_fused_hook_harness.stand_ins.megatron_cpu import enable_cpu_megatron

    enable_cpu_megatron()  # megatron allocates the gather's output on torch.cuda.current_device(): "cpu" here
    if sequence_parallel:

        def gather(leaf):
            return gather_from_sequence_parallel_region(leaf, tensor_parallel_output_grad=True, group=dist.group.WORLD)

        return _op(rank, world_size, "partial", sliced=True, map_hidden=gather)
    return _op(
        rank,
        world_size,
        "partial",
        map_hidden=lambda leaf: copy_to_tensor_model_parallel_region(leaf, group=dist.group.WORLD),
    )


def _refused_labels(rank, world_size):
    full, weight, labels, *_ = case_inputs()
    rows = S // world_size
    try:
        log_probs_and_entropy(
            full[:rows],
            weight.chunk(world_size)[rank],
            labels[:rows],
            tp_group=dist.group.WORLD,
            tp_hidden="sequence_sharded",
            vocab_size=VOCAB,
        )
    except ValueError as error:
        return str(error)
    return None


def all_layouts_worker(rank, world_size):
    """Every case in one spawn (process start-up dominates the cost)."""
    out = {mode: _op(rank, world_size, mode) for mode in TP_HIDDEN_CHOICES}
    out["loss_inside sequence_sharded"] = _op(rank, world_size, "sequence_sharded", fused_loss=True)
    out["loss_inside replicated"] = _op(rank, world_size, "replicated", fused_loss=True)
    out["megatron copy_to"] = _through_megatron(rank, world_size, sequence_parallel=False)
    out["megatron sequence gather"] = _through_megatron(rank, world_size, sequence_parallel=True)
    out["refused labels"] = _refused_labels(rank, world_size)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_in_processes(all_layouts_worker, 2)


def _check_outputs(results, want_lp, want_ent):
    for log_probs, entropy, *_ in results:
        assert torch.equal(log_probs, results[0][0]) and torch.equal(entropy, results[0][1]), "ranks must agree"
        assert compare.max_abs(log_probs, want_lp) <= ATOL and compare.max_abs(entropy, want_ent) <= ATOL


@pytest.mark.parametrize("case", ["replicated", "loss_inside replicated"])
def test_replicated_gives_every_rank_the_full_gradient(ranks, case):
    want_lp, want_ent, want_dh, want_dw = reference()
    results = [per_rank[case] for per_rank in ranks]
    _check_outputs(results, want_lp, want_ent)
    for _, _, d_hidden, _ in results:
        assert torch.equal(d_hidden, results[0][2]), "the all-reduce leaves every rank the same gradient"
        assert compare.error(want_dh, d_hidden, relative=True) <= GRAD_RTOL
    assert compare.error(want_dw, torch.cat([r[3] for r in results]), relative=True) <= GRAD_RTOL


@pytest.mark.parametrize("case", ["sequence_sharded", "loss_inside sequence_sharded"])
def test_sequence_sharded_gives_each_rank_the_gradient_of_its_slice(ranks, case):
    want_lp, want_ent, want_dh, want_dw = reference()
    results = [per_rank[case] for per_rank in ranks]
    _check_outputs(results, want_lp, want_ent)  # outputs cover every row, as labels do
    for rank, (_, _, d_hidden, _) in enumerate(results):
        assert d_hidden.shape == (S // 2, B, H)
        assert compare.error(want_dh.chunk(2)[rank], d_hidden, relative=True) <= GRAD_RTOL
    assert compare.error(want_dw, torch.cat([r[3] for r in results]), relative=True) <= GRAD_RTOL


def test_partial_gives_each_rank_its_shards_part(ranks):
    want_lp, want_ent, want_dh, want_dw = reference()
    results = [per_rank["partial"] for per_rank in ranks]
    _check_outputs(results, want_lp, want_ent)
    assert compare.error(want_dh, results[0][2], relative=True) > 1e-2  # one shard's part is not the gradient
    assert compare.error(want_dh, sum(r[2] for r in results), relative=True) <= GRAD_RTOL


@pytest.mark.parametrize(
    "mode, megatron", [("replicated", "megatron copy_to"), ("sequence_sharded", "megatron sequence gather")]
)
def test_same_bits_as_megatrons_mappings(ranks, mode, megatron):
    for per_rank in ranks:
        for ours, theirs in zip(per_rank[mode], per_rank[megatron]):
            assert torch.equal(ours, theirs)


def test_sequence_sharded_labels_must_cover_every_row(ranks):
    for per_rank in ranks:
        message = per_rank["refused labels"]
        assert message is not None and message.startswith("labels: must be shaped like hidden without its last dim")
        assert "tp_hidden='sequence_sharded'" in message and "(12, 3)" in message


@pytest.mark.parametrize("tp_hidden", TP_HIDDEN_CHOICES)
def test_one_rank_ignores_the_layout(tp_hidden):
    hidden, weight, labels, temperature, score_mask, grads = case_inputs()
    runs = []
    for layout in ("replicated", tp_hidden):
        h = hidden.clone().requires_grad_(True)
        lp, ent = log_probs_and_entropy(h, weight, labels, temperature=temperature, tp_hidden=layout, backend="torch")
        (lp * grads[0] + ent * grads[1]).sum().backward()
        runs.append((lp, ent, h.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", ["log_probs_and_entropy", "log_probs_entropy_and_loss"])
def test_unknown_layout_names_the_field(op):
    hidden, weight, labels, *_ = case_inputs()
    extra = {} if op == "log_probs_and_entropy" else dict(loss_fn=lambda lp, ent: (lp.sum(), {}), loss_name="x")
    function = log_probs_and_entropy if op == "log_probs_and_entropy" else log_probs_entropy_and_loss
    with pytest.raises(
        ValueError, match=r"tp_hidden: unknown 'sharded'; allowed: replicated, sequence_sharded, partial"
    ):
        function(hidden, weight, labels, tp_hidden="sharded", **extra)
