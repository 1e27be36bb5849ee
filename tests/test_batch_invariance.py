"""Batch invariance on the CPU: a row's log-prob and entropy come out with the same bits whatever batch computes it.

Exact on-policy training needs it: verl computes the old log-probs and the update's forward in different micro-batches,
and the PPO ratio is exactly 1 only if a sequence's log-probs do not depend on the rows beside it. Checked here with the
portable backend (fp32 and bf16 inputs) and, through Triton's interpreter, with the Triton backend's host code (the
split layout of the forward kernel and the merges); tests/gpu/test_batch_invariance_cuda.py checks the Triton kernels.
Every comparison is bitwise (torch.equal), never a tolerance.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_interpreter import _run_interpreted

from verl_fused_hook import log_probs_and_entropy, log_probs_entropy_and_loss
from verl_fused_hook.ops.softmax_math import ordered_sum
from verl_fused_hook_harness.support.distributed import run_in_processes

H, V, VOCAB = 48, 1003, 997  # a vocabulary that divides nothing, padded columns past 997
PROBE = 7  # the rows whose values must not move


def _inputs(dtype: torch.dtype, rows: int = 600, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(V, H, generator=generator) * 0.5).to(dtype)
    hidden = torch.randn(rows, H, generator=generator).to(dtype)
    labels = torch.randint(0, VOCAB, (rows,), generator=generator)
    temperature = torch.rand(rows, generator=generator) + 0.5  # per-row temperatures
    return hidden, weight, labels, temperature


def _probe_values(hidden, weight, labels, temperature, where: slice, **options):
    log_probs, entropy = log_probs_and_entropy(
        hidden, weight, labels, temperature=temperature, vocab_size=VOCAB, backend="torch", **options
    )
    return log_probs[where], entropy[where]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_values_do_not_depend_on_its_batch(dtype):
    hidden, weight, labels, temperature = _inputs(dtype)
    alone = _probe_values(hidden[:PROBE], weight, labels[:PROBE], temperature[:PROBE], slice(None))
    others = slice(PROBE, None)
    for count in (1, 3, 8, 100, 593):
        rest = slice(PROBE, PROBE + count)
        first = [torch.cat([t[:PROBE], t[rest]]) for t in (hidden, labels, temperature)]
        last = [torch.cat([t[rest], t[:PROBE]]) for t in (hidden, labels, temperature)]
        cases = {
            "first": _probe_values(*first[:1], weight, *first[1:], slice(0, PROBE)),
            "last": _probe_values(*last[:1], weight, *last[1:], slice(-PROBE, None)),
            "last, row tiles of 8": _probe_values(*last[:1], weight, *last[1:], slice(-PROBE, None), tile_rows=8),
            "last, row tiles of 40": _probe_values(*last[:1], weight, *last[1:], slice(-PROBE, None), tile_rows=40),
        }
        mask = torch.arange(count + PROBE) % 3 != 0
        mask[-PROBE:] = True
        cases["last, others masked"] = _probe_values(*last[:1], weight, *last[1:], slice(-PROBE, None), score_mask=mask)
        for name, (log_probs, entropy) in cases.items():
            assert torch.equal(log_probs, alone[0]) and torch.equal(entropy, alone[1]), (count, name)
    other_rows = hidden[others].flip(0)  # other rows, other values
    swapped = torch.cat([other_rows[:50], hidden[:PROBE]]), torch.cat([labels[others][:50], labels[:PROBE]])
    values = _probe_values(
        swapped[0], weight, swapped[1], torch.cat([temperature[others][:50], temperature[:PROBE]]), slice(-PROBE, None)
    )
    assert torch.equal(values[0], alone[0]) and torch.equal(values[1], alone[1])


@pytest.mark.parametrize("chunk_rows", [None, 16, 64])
def test_the_fused_loss_computes_the_same_values_as_the_two_pass_op(chunk_rows):
    """The loss inside the op (its chunk plan follows the budget and the free memory) computes each row's log-prob
    and entropy with the same bits as the two-pass op, whatever its chunks."""
    hidden, weight, labels, temperature = _inputs(torch.float32, rows=300, seed=1)
    two_pass = _probe_values(hidden, weight, labels, temperature, slice(None))
    result = log_probs_entropy_and_loss(
        hidden.clone().requires_grad_(True),
        weight.clone().requires_grad_(True),
        labels,
        temperature=temperature,
        vocab_size=VOCAB,
        backend="torch",
        loss_fn=lambda lp, ent: ((lp - 0.1 * ent).sum(), {}),
        loss_name="lp",
        chunk_rows=chunk_rows,
    )
    assert torch.equal(result.log_probs, two_pass[0]) and torch.equal(result.entropy, two_pass[1])


def test_ordered_sum_adds_in_an_order_fixed_by_the_count_of_terms():
    """Pairwise halving: ((a + b) + (c + d)) + (e + 0), the same for a column whatever columns sit beside it."""
    terms = torch.tensor([[1e8], [1.0], [-1e8], [1.0], [0.5]], dtype=torch.float32)
    a, b, c, d, e = terms[:, 0]
    assert ordered_sum(terms)[0] == ((a + b) + (c + d)) + e
    wide = torch.randn(33, 1000)
    narrow = ordered_sum(wide[:, :3])
    assert torch.equal(ordered_sum(wide)[:3], narrow)


def _tensor_parallel_probe(rank: int, world_size: int):
    """One rank's vocabulary shard: the probe rows alone and inside batches (placed last)."""
    import torch.distributed as dist

    hidden, weight, labels, temperature = _inputs(torch.float32, rows=300, seed=2)
    shard = torch.cat([weight, weight.new_zeros(-V % world_size, H)]).chunk(world_size)[rank]

    def values(h, y, t, where):
        lp, ent = log_probs_and_entropy(
            h, shard, y, temperature=t, vocab_size=VOCAB, tp_group=dist.group.WORLD, backend="torch"
        )
        return [lp[where].tolist(), ent[where].tolist()]

    alone = values(hidden[:PROBE], labels[:PROBE], temperature[:PROBE], slice(None))
    inside = {}
    for count in (1, 90, 293):
        rest = slice(PROBE, PROBE + count)
        joined = [torch.cat([t[rest], t[:PROBE]]) for t in (hidden, labels, temperature)]
        inside[count] = values(*joined, slice(-PROBE, None))
    return {"alone": alone, "inside": inside}


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_values_do_not_depend_on_the_batch(world_size):
    """At a fixed TP size: the ranks' partials are all-gathered and merged in rank order, not all-reduced (whose
    summation order follows the message size); every rank returns the same bits."""
    results = run_in_processes(_tensor_parallel_probe, world_size)
    for rank_result in results:
        assert rank_result["alone"] == results[0]["alone"]
        for count, values in rank_result["inside"].items():
            assert values == results[0]["alone"], (count,)


def test_triton_forward_does_not_depend_on_the_batch_whatever_its_layout_in_the_interpreter():
    """The Triton backend's host side and kernels (through Triton's interpreter, tests/test_triton_interpreter.py's
    named fakes), batch_invariant off (the default) and on: the forward's split layout follows the row count (the
    calls below take two layouts) and long calls run as several launches, yet each column tile's partial is written
    apart and the tiles are merged in an order fixed by the width, so a row alone, with 3, 40 or 300 more rows
    (some masked, some with kept logits) and in a call of several launches gives the same bits."""
    cases = _run_interpreted("_interpreted_batch_invariance")
    assert len(cases["layouts"]) > 1, cases  # different split layouts computed the same bits
    assert cases["launches"] > 1, cases
    assert cases["same_bits"], cases


def test_the_split_layout_follows_the_row_count_and_a_launch_bounds_its_partials():
    """The Triton forward's vocabulary splits (host side, no kernel): the fastest modelled layout for the call's
    rows, e.g. 501 column tiles (128256 columns) on 132 SMs: 18 splits of 28 at 32768 rows, 16 of 32 at 1024 (a
    layout fixed per width took 8 of 63 everywhere: half the SMs idle at 1024 rows); and the rows of one launch
    keep its per-tile partials (fp32, 4 planes, 5 with square sums) under TILE_PARTIALS_BUDGET_BYTES."""
    from verl_fused_hook.ops.backends.forward_layout import TILE_PARTIALS_BUDGET_BYTES, tile_partial_rows
    from verl_fused_hook.ops.backends.triton_backend import tiles_per_split

    assert tiles_per_split(501, 132, 32768 // 128) == 28
    assert tiles_per_split(501, 132, 1024 // 128) == 32
    assert tiles_per_split(594, 132, 8192 // 128) == 18
    for tiles, planes in ((594, 4), (594, 5), (970, 4), (75, 4)):
        rows = tile_partial_rows(tiles, planes, 128)
        assert rows % 128 == 0 and rows * tiles * planes * 4 <= TILE_PARTIALS_BUDGET_BYTES
        assert (rows + 128) * tiles * planes * 4 > TILE_PARTIALS_BUDGET_BYTES
    assert tile_partial_rows(594, 4, 128) == 28160  # 151936 columns: 27.5k rows a launch


def test_the_flag_is_checked_and_carried():
    from verl_fused_hook import FusedOutputProcessorContext
    from verl_fused_hook.ops import arguments, backend_unavailable_at_build

    hidden, weight, labels, temperature = _inputs(torch.float32, rows=20)
    with pytest.raises(ValueError, match="^batch_invariant: expected a bool, got 'yes'$"):
        log_probs_and_entropy(hidden, weight, labels, batch_invariant="yes")
    with pytest.raises(ValueError, match="^FusedOutputProcessorContext.batch_invariant: expected a bool"):
        FusedOutputProcessorContext(batch_invariant=1)
    problems = [
        arguments.build_problem(
            hidden,
            weight,
            labels,
            temperature=1.0,
            tp_group=None,
            score_mask=None,
            ignore_index=-100,
            vocab_size=None,
            calculate_entropy=True,
            tile_rows=None,
            batch_invariant=flag,
        )  # fmt: skip
        for flag in (False, True)
    ]
    assert [p.batch_invariant for p in problems] == [False, True]
    # the portable backend cannot promise it on a GPU (cuBLAS picks kernels by shape): refused at model build
    assert backend_unavailable_at_build("torch", hidden_size=H, device_type="cuda", batch_invariant=True).startswith(
        "batch_invariant=True: on CUDA the portable backend"
    )
    assert backend_unavailable_at_build("torch", hidden_size=H, device_type="cpu", batch_invariant=True) is None
    assert backend_unavailable_at_build("triton", hidden_size=H, device_type="cuda", batch_invariant=True) != (
        backend_unavailable_at_build("torch", hidden_size=H, device_type="cuda", batch_invariant=True)
    )
    # on the CPU the portable backend is invariant either way: the flag leaves its values' bits alone
    on, off = (
        _probe_values(hidden, weight, labels, temperature, slice(None), batch_invariant=f) for f in (True, False)
    )
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
