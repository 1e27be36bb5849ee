"""`log_probs_entropy_and_loss` with sequence-level losses (`row_groups`), its two-pass path, and chunks sized from
free memory (CPU, portable passes; the free-memory reading injected by monkeypatching `chunking.available_bytes`).

Reference: `log_probs_and_entropy` (checked against fp64 in test_op.py), the same loss on its outputs, autograd.
The loss is GSPO's: a sequence's importance ratio is the exp of the mean of its log-prob differences, so a row's
gradient depends on every scored row of its sequence. Sequences of very different lengths, packed (THD-like)
with unscored prompts between them, cross several chunk boundaries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch

from verl_fused_hook.ops import (
    LossGradientError,
    NonFiniteLossGradientError,
    NonSeparableLossError,
    chunking,
    log_probs_and_entropy,
    log_probs_entropy_and_loss,
)
from verl_fused_hook.ops.arguments import build_problem
from verl_fused_hook.ops.backends.torch_backend import loss_inside_cost

RTOL = 1e-5
PROMPTS = (4, 2, 6, 3, 5, 2, 3, 4)
RESPONSES = (30, 370, 50, 210, 20, 110, 80, 140)  # scored rows per sequence: 1010 in all
H, V = 12, 97


@dataclass
class Batch:
    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    score_mask: torch.Tensor
    row_groups: torch.Tensor
    index: torch.Tensor  # [B, T] flat row of each response token (0 where padded)
    mask: torch.Tensor  # [B, T] float response mask
    old_log_prob: torch.Tensor
    advantages: torch.Tensor


def batch(seed=0) -> Batch:
    """Packed sequences (prompt unscored, response scored) and 3 padding rows of no group."""
    g = torch.Generator().manual_seed(seed)
    groups, scored, index = [], [], torch.zeros(len(RESPONSES), max(RESPONSES), dtype=torch.long)
    for seq, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        start = len(groups)
        groups += [seq] * (p + r)
        scored += [False] * p + [True] * r
        index[seq, :r] = torch.arange(start + p, start + p + r)
    groups += [-1] * 3
    scored += [False] * 3
    n = len(groups)
    mask = (torch.arange(max(RESPONSES)) < torch.tensor(RESPONSES).unsqueeze(1)).float()
    return Batch(
        hidden=torch.randn(n, H, generator=g),
        weight=torch.randn(V, H, generator=g) * 0.6,
        labels=torch.randint(0, V, (n,), generator=g),
        score_mask=torch.tensor(scored),
        row_groups=torch.tensor(groups),
        index=index,
        mask=mask,
        old_log_prob=-torch.rand(mask.shape, generator=g) * 4 * mask,
        advantages=torch.randn(len(RESPONSES), 1, generator=g).expand_as(mask).clone(),
    )


def gspo(b: Batch, entropy_coeff=0.01):
    """verl's compute_policy_loss_gspo (seq-mean-token-mean) on the padded responses, minus an entropy bonus."""
    from verl.trainer.ppo.core_algos import compute_policy_loss_gspo
    from verl.workers.config import ActorConfig

    config = ActorConfig(strategy="megatron", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1)

    def loss_fn(log_probs, entropy):
        padded = log_probs.reshape(-1)[b.index] * b.mask
        loss, metrics = compute_policy_loss_gspo(
            b.old_log_prob, padded, b.advantages, b.mask, "seq-mean-token-mean", config
        )
        if entropy is None:
            return loss, metrics
        bonus = (entropy.reshape(-1)[b.index] * b.mask).sum() / b.mask.sum()
        return loss - entropy_coeff * bonus, metrics

    return loss_fn


def two_pass_reference(b: Batch, loss_fn):
    hidden, weight = b.hidden.clone().requires_grad_(True), b.weight.clone().requires_grad_(True)
    lp, ent = log_probs_and_entropy(hidden, weight, b.labels, temperature=0.8, score_mask=b.score_mask, backend="torch")
    loss, metrics = loss_fn(lp, ent)
    return loss.detach(), metrics, lp.detach(), ent.detach(), torch.autograd.grad(loss, (hidden, weight))


def fused(b: Batch, loss_fn, loss_name="gspo", **kwargs):
    hidden, weight = b.hidden.clone().requires_grad_(True), b.weight.clone().requires_grad_(True)
    result = log_probs_entropy_and_loss(
        hidden,
        weight,
        b.labels,
        loss_fn=loss_fn,
        loss_name=loss_name,
        temperature=0.8,
        score_mask=b.score_mask,
        backend="torch",
        **kwargs,
    )
    return result, torch.autograd.grad(result.loss, (hidden, weight))


def assert_matches(result, grads, reference):
    loss, metrics, lp, ent, want = reference
    torch.testing.assert_close(result.loss, loss, rtol=RTOL, atol=0)
    assert result.metrics == pytest.approx(metrics, rel=RTOL, abs=1e-7)
    assert torch.equal(result.log_probs.detach(), lp) and torch.equal(result.entropy.detach(), ent)
    for got, ref in zip(grads, want):
        assert float((got - ref).abs().max()) <= RTOL * float(ref.abs().max())


def chunk_ends(calls):
    """The scored rows computed at each per-chunk loss_fn call (the last call is the final evaluation)."""
    return [int(lp.ne(0).sum()) for lp in calls[:-1]]


def recording(loss_fn, calls):
    def wrapped(lp, ent):
        calls.append(lp.detach().clone())
        return loss_fn(lp, ent)

    return wrapped


def test_gspo_with_row_groups_matches_the_two_pass_op():
    b = batch()
    calls = []
    result, grads = fused(b, recording(gspo(b), calls), chunk_rows=480, row_groups=b.row_groups)
    assert_matches(result, grads, two_pass_reference(b, gspo(b)))
    # whole sequences, in as few chunks as 480 rows allow (three), each cut at the sequence end nearest a third:
    # (30, 370) (50, 210, 20) (110, 80, 140), not greedy's (30, 370, 50) (210, 20, 110, 80) (140)
    assert chunk_ends(calls) == [400, 680, 1010]


def test_gspo_without_row_groups_is_refused():
    b = batch()
    with pytest.raises(
        NonSeparableLossError, match=r"loss gspo: its gradient in the log-prob of a row depends on other rows"
    ):
        fused(b, gspo(b), chunk_rows=480)


def test_row_groups_that_split_a_sequence_are_still_refused():
    """The looser bound with row groups (rounding of per-group sums, GROUP_SEPARABILITY_RTOL) still catches a
    sequence whose rows fall in two chunks: here every row is its own group, so chunks cut sequences."""
    b = batch()
    every_row = torch.arange(b.row_groups.numel()).view(b.row_groups.shape)
    # two chunks of 505 rows: the cut falls in the 210-row sequence, at rows where it changes the gradient (a cut
    # where GSPO's clipping leaves every gradient unchanged, as 480 rows' even chunks make here, is exact)
    with pytest.raises(
        NonSeparableLossError, match=r"loss gspo: its gradient in the log-prob of a row depends on other rows"
    ):
        fused(b, gspo(b), chunk_rows=505, row_groups=every_row)


def test_row_groups_allow_the_rounding_of_group_sums_and_no_more():
    """Row gradients 1e-5 off (the size of two fp32 summation orders over a long sequence) pass with row groups
    and are refused without; 1e-2 off is refused with them too."""
    from verl_fused_hook.ops.separability import GROUP_SEPARABILITY_RTOL, SEPARABILITY_RTOL

    b = batch()
    loss_fn = gspo(b, entropy_coeff=0.0)

    def row_gradients_off_by(relative):
        def row_gradients(rows, lp, ent):
            full_lp = torch.zeros(b.labels.numel())
            full_lp[rows] = lp
            with torch.enable_grad():
                probe = full_lp.requires_grad_(True)
                (g,) = torch.autograd.grad(loss_fn(probe.view(b.labels.shape), None)[0], probe)
            return g[rows] * (1 + relative), None

        return row_gradients

    assert SEPARABILITY_RTOL < 1e-5 < GROUP_SEPARABILITY_RTOL < 1e-2
    groups = dict(row_groups=b.row_groups, chunk_rows=480, calculate_entropy=False)
    fused(b, loss_fn, row_gradients=row_gradients_off_by(1e-5), **groups)
    with pytest.raises(NonSeparableLossError, match="row_gradients disagree"):
        fused(b, loss_fn, row_gradients=row_gradients_off_by(1e-2), **groups)
    with pytest.raises(NonSeparableLossError, match="row_gradients disagree"):
        fused(b, loss_fn, row_gradients=row_gradients_off_by(1e-5), chunk_rows=1010, calculate_entropy=False)


def test_a_group_longer_than_a_chunk_takes_the_two_pass_path(caplog):
    b = batch()
    with caplog.at_level(logging.DEBUG, logger="verl_fused_hook.ops.chunking"):
        result, grads = fused(b, gspo(b), loss_name="gspo long group", chunk_rows=300, row_groups=b.row_groups)
        fused(b, gspo(b), loss_name="gspo long group", chunk_rows=300, row_groups=b.row_groups)
    assert_matches(result, grads, two_pass_reference(b, gspo(b)))
    message = (
        "log_probs_entropy_and_loss: loss gspo long group: row group 1 has 370 scored rows, more than a chunk holds "
        "(300 rows, set by chunk_rows=300); this call runs the two-pass path (logits recomputed in backward). A larger "
        "chunk_bytes or chunk_rows keeps such sequences in the fused loss"
    )
    levels = [r.levelno for r in caplog.records if r.getMessage() == message]
    assert levels == [logging.WARNING, logging.DEBUG]  # once per loss and reason, then at debug level


def test_the_two_pass_path_keeps_the_fused_contract():
    """A gradient reaching the returned log-probs raises; a non-finite loss gradient is named; no gradient: same
    values."""
    b = batch()
    result, _ = fused(b, gspo(b), loss_name="gspo contract", chunk_rows=300, row_groups=b.row_groups)
    with pytest.raises(LossGradientError, match=r"loss gspo contract: a gradient reached the log-probs returned"):
        (result.loss + result.log_probs.sum()).backward()

    def infinite(lp, ent):
        scale = torch.ones_like(lp)
        scale.view(-1)[b.index[1, 4]] = float("inf")
        return (lp * scale).sum(), {}

    with pytest.raises(
        NonFiniteLossGradientError, match=rf"in the log-prob of 1 scored rows \(first: row {int(b.index[1, 4])}, "
    ):
        fused(b, infinite, loss_name="infinite", chunk_rows=300, row_groups=b.row_groups)
    with torch.no_grad():
        plain = log_probs_entropy_and_loss(
            b.hidden,
            b.weight,
            b.labels,
            loss_fn=gspo(b),
            loss_name="gspo",
            temperature=0.8,
            score_mask=b.score_mask,
            chunk_rows=300,
            row_groups=b.row_groups,
        )
    torch.testing.assert_close(plain.loss, result.loss.detach(), rtol=RTOL, atol=0)


def test_row_groups_must_be_contiguous_and_shaped_like_labels():
    b = batch()
    groups = b.row_groups.clone()
    groups[b.index[3, 10]] = 0  # a row of sequence 3 claimed by sequence 0
    with pytest.raises(
        ValueError,
        match=rf"row_groups: the scored rows of group 0 are not contiguous .*: scored row "
        rf"{int(b.index[1, 0])} of another group \(or of none\) lies between its rows "
        rf"{int(b.index[0, RESPONSES[0] - 1])} and {int(b.index[3, 10])}\.",
    ):
        fused(b, gspo(b), chunk_rows=480, row_groups=groups)
    for bad, match in (
        (b.row_groups.float(), "must be an integer tensor"),
        (b.row_groups[:-1], "must be shaped like labels"),
        ([0, 1], "expected None or an int64 tensor"),
    ):
        with pytest.raises(ValueError, match=f"row_groups: {match}"):
            fused(b, gspo(b), row_groups=bad)


# --- chunks sized from free memory ------------------------------------------------------------------------------


def _problem(b: Batch, hidden, weight, labels=None, vocab_size=None):
    """The loss-inside call's checked problem for batch `b` (temperature 0.8, its score mask) with these tensors."""
    return build_problem(
        hidden,
        weight,
        b.labels if labels is None else labels,
        temperature=0.8,
        tp_group=None,
        score_mask=b.score_mask,
        ignore_index=-100,
        vocab_size=vocab_size,
        calculate_entropy=True,
        tile_rows=None,
    )


def _cost_and_fixed(b: Batch, dtype=torch.float32):
    """The portable passes' ChunkCost and the call's fixed bytes (gradients, per-row vectors, margin) for `b`."""
    p = _problem(b, b.hidden.to(dtype), b.weight.to(dtype))
    cost = loss_inside_cost(p, True)
    fixed = (
        cost.fixed_bytes
        + chunking.ROW_VECTOR_BYTES * p.num_rows
        + chunking.FREE_MEMORY_MARGIN_BYTES
        + p.hidden.numel() * p.hidden.element_size()
        + p.weight.numel() * p.weight.element_size()
    )
    accumulator = 0 if dtype == torch.float32 else 4 * V * H
    return cost, fixed, accumulator


def _weighted_sum(n):
    g = torch.Generator().manual_seed(9)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return (
        lambda lp, ent: ((lp * g_lp).sum() + (ent * g_ent).sum(), {}),
        lambda rows, lp, ent: (g_lp[rows], g_ent[rows]),
    )


def _chunk_sizes(b: Batch, monkeypatch, available, dtype=torch.float32, **kwargs):
    monkeypatch.setattr(chunking, "available_bytes", lambda device, enough=None: available)
    loss_fn, row_gradients = _weighted_sum(b.labels.numel())
    sizes = []

    def counting(rows, lp, ent):
        sizes.append(rows.numel())
        return row_gradients(rows, lp, ent)

    hidden, weight = b.hidden.to(dtype).requires_grad_(True), b.weight.to(dtype).requires_grad_(True)
    result = log_probs_entropy_and_loss(
        hidden,
        weight,
        b.labels,
        loss_fn=loss_fn,
        loss_name="weighted sum",
        temperature=0.8,
        score_mask=b.score_mask,
        backend="torch",
        row_gradients=counting,
        **kwargs,
    )
    return sizes, result, torch.autograd.grad(result.loss, (hidden, weight))


def test_chunk_rows_shrink_when_free_memory_is_short(monkeypatch):
    b = batch()
    scored = int(b.score_mask.sum())  # 1010
    cost, fixed, _ = _cost_and_fixed(b)
    budget = 4 * V * 400  # 400 rows of fp32 logits
    plenty, _, _ = _chunk_sizes(b, monkeypatch, 1 << 50, chunk_bytes=budget)
    assert plenty == [337, 337, 336]  # the budget's 400 rows, as equal chunks
    short, result, grads = _chunk_sizes(
        b, monkeypatch, fixed + 210 * cost.row_bytes + cost.row_bytes // 2, chunk_bytes=budget
    )
    assert short == [202] * 5  # 210 rows fit: five equal chunks of at most 210
    assert sum(short) == scored
    none_query, _, _ = _chunk_sizes(b, monkeypatch, None, chunk_bytes=budget)
    assert none_query == plenty  # no reading (CPU): the budget alone
    loss_fn, _ = _weighted_sum(b.labels.numel())
    assert_matches(result, grads, two_pass_reference(b, loss_fn))


@pytest.mark.parametrize("row_multiple", [1, 128])  # the portable passes' and the Triton passes'
@pytest.mark.parametrize("request_", [{"chunk_bytes": 4 * V * 400}, {"chunk_rows": 200}, {"chunk_rows": 1000}, {}])
def test_the_free_memory_the_plan_calls_enough_plans_as_plenty_does(monkeypatch, row_multiple, request_):
    """The plan tells available_bytes how much free memory leaves its decisions to the budget (the driver's free
    memory alone answers then, without the allocator's statistics): exactly that much must plan as unlimited
    memory does (chunk requests off the row multiple included), and less may not plan larger chunks."""
    b = batch()
    cost, _, _ = _cost_and_fixed(b)
    cost = chunking.ChunkCost(
        cost.stored_row_bytes, cost.transient_row_bytes, cost.fixed_bytes, 128, row_multiple, cost.budget_bytes
    )
    p = _problem(b, b.hidden.requires_grad_(True), b.weight.requires_grad_(True))
    asked = []

    def plan(available):
        def reading(device, enough=None):
            asked.append(enough)
            return available

        monkeypatch.setattr(chunking, "available_bytes", reading)
        return chunking.plan_chunks(
            p,
            cost,
            want_grads=True,
            chunk_rows=request_.get("chunk_rows"),
            chunk_bytes=request_.get("chunk_bytes"),
            groups=None,
            loss_name="x",
        )

    plenty = plan(1 << 50)
    enough = asked[-1]
    assert enough is not None
    assert plan(enough) == plenty
    shorter = plan(enough - cost.row_bytes * row_multiple)
    assert shorter is None or max(s.stop - s.start for s in shorter) <= max(s.stop - s.start for s in plenty)


def test_the_accumulator_counts_only_with_several_chunks(monkeypatch):
    """bf16 weight: the fp32 d_weight accumulator (4 V H bytes) is needed beside several chunks, not beside one."""
    b = batch()
    cost, fixed, accumulator = _cost_and_fixed(b, torch.bfloat16)
    scored = int(b.score_mask.sum())
    one, _, _ = _chunk_sizes(b, monkeypatch, fixed + scored * cost.row_bytes, torch.bfloat16)
    assert one == [scored]
    several, _, _ = _chunk_sizes(b, monkeypatch, fixed + scored * cost.row_bytes - 1, torch.bfloat16)
    fit = (scored * cost.row_bytes - 1 - accumulator) // cost.row_bytes
    assert max(several) <= fit < scored and len(several) == -(-scored // fit)


def test_no_smallest_chunk_in_free_memory_takes_the_two_pass_path(monkeypatch, caplog):
    b = batch()
    cost, fixed, _ = _cost_and_fixed(b)
    monkeypatch.setattr(chunking, "available_bytes", lambda device, enough=None: fixed + 127 * cost.row_bytes)
    loss_fn, _ = _weighted_sum(b.labels.numel())
    with caplog.at_level(logging.WARNING, logger="verl_fused_hook.ops.chunking"):
        result, grads = fused(b, loss_fn, loss_name="short of memory")
    assert_matches(result, grads, two_pass_reference(b, loss_fn))
    need = fixed + 128 * cost.row_bytes  # the portable passes' smallest chunk: 128 rows

    def mib(count):
        return f"{count / 2**20:.1f} MiB"

    assert [r.getMessage() for r in caplog.records] == [
        f"log_probs_entropy_and_loss: loss short of memory: too little free GPU memory for a chunk of 128 rows: "
        f"{mib(need)} needed ({mib(128 * cost.row_bytes)} for the chunk, 0.0 MiB for the fp32 d_weight accumulator, "
        f"{mib(fixed)} for the gradients, per-row vectors and the 256.0 MiB margin), "
        f"{mib(fixed + 127 * cost.row_bytes)} "
        "free on cpu; this call runs the two-pass path (logits recomputed in backward)"
    ]


def test_buffers_the_allocator_cannot_give_send_the_call_to_the_two_pass_path(monkeypatch, caplog):
    """Free memory counted but in pieces (a fragmented cache): the kept-logits buffer's allocation fails before any
    work, and the call runs the two-pass path with a warning instead of going out of memory halfway."""
    from verl_fused_hook.ops.backends import torch_backend

    def no_memory(p, keep, spans):  # stands in for the allocator's refusal, which only a GPU gives
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB.")

    monkeypatch.setattr(torch_backend, "loss_inside_passes", no_memory)
    b = batch()
    loss_fn, row_gradients = _weighted_sum(b.labels.numel())
    asked = []
    with caplog.at_level(logging.WARNING, logger="verl_fused_hook.ops.chunking"):
        result, grads = fused(
            b,
            loss_fn,
            loss_name="fragmented",
            row_gradients=lambda rows, lp, ent: asked.append(rows) or row_gradients(rows, lp, ent),
        )
    assert asked == []  # no chunk ran: the two-pass path never asks for row gradients
    assert_matches(result, grads, two_pass_reference(b, loss_fn))
    assert [r.getMessage() for r in caplog.records] == [
        "log_probs_entropy_and_loss: loss fragmented: the chunk of kept logits or the fp32 d_weight accumulator could "
        "not be allocated (CUDA out of memory. Tried to allocate 2.32 GiB.); this call runs the two-pass path (logits "
        "recomputed in backward)"
    ]


def test_chunks_from_free_memory_still_respect_row_groups(monkeypatch):
    b = batch()
    cost, fixed, _ = _cost_and_fixed(b)
    monkeypatch.setattr(chunking, "available_bytes", lambda device, enough=None: fixed + 500 * cost.row_bytes)
    calls = []
    result, grads = fused(b, recording(gspo(b), calls), chunk_rows=1000, row_groups=b.row_groups)
    assert chunk_ends(calls) == [400, 680, 1010]  # 500 rows fit: three chunks, cut nearest each third
    assert_matches(result, grads, two_pass_reference(b, gspo(b)))


# --- tensor parallelism (two gloo processes) ---------------------------------------------------------------------

SHARD = 49  # the vocabulary padded to 98 columns: rank 1's last column is padding (vocab_size=V)


def _rank_call(rank, b: Batch, loss_fn, available, **kwargs):
    """One rank's fused call with its free-memory reading; (chunk ends, loss, d_hidden, d_weight shard) or the error."""
    import torch.distributed as dist

    chunking.available_bytes = lambda device, enough=None: available
    calls = []
    padded = torch.cat([b.weight, torch.zeros(2 * SHARD - V, H)])
    hidden = b.hidden.clone().requires_grad_(True)
    shard = padded[rank * SHARD : (rank + 1) * SHARD].clone().requires_grad_(True)
    try:
        result = log_probs_entropy_and_loss(
            hidden,
            shard,
            b.labels,
            loss_fn=recording(loss_fn, calls),
            loss_name="gspo tp",
            temperature=0.8,
            score_mask=b.score_mask,
            backend="torch",
            tp_group=dist.group.WORLD,
            vocab_size=V,
            **kwargs,
        )
        grads = torch.autograd.grad(result.loss, (hidden, shard))
    except ValueError as error:
        return str(error)
    return chunk_ends(calls), result.loss.detach(), result.metrics, grads[0], grads[1]


def _rank_room(rank, b: Batch, rows: int) -> int:
    """A free-memory reading that holds `rows` rows of this rank's chunk and no more."""
    valid = min(SHARD, V - rank * SHARD)
    p = _problem(b, b.hidden, b.weight[:SHARD], b.labels % valid, valid)
    cost = loss_inside_cost(p, True)
    fixed = (
        cost.fixed_bytes
        + chunking.ROW_VECTOR_BYTES * p.num_rows
        + chunking.FREE_MEMORY_MARGIN_BYTES
        + p.hidden.numel() * 4
        + p.weight.numel() * 4
    )
    return fixed + rows * cost.row_bytes + cost.row_bytes // 2


def _refused_on(rank, refusing: int, b: Batch, loss_fn):
    """`_rank_call` where rank `refusing`'s allocator refuses the kept-logits buffer (simulated: no GPU here), with
    the warnings this rank logged."""
    import logging

    from verl_fused_hook.ops.backends import torch_backend

    original, messages = torch_backend.loss_inside_passes, []

    def refuse(p, keep, spans):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB.")

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("verl_fused_hook.ops.chunking").addHandler(handler)
    if rank == refusing:
        torch_backend.loss_inside_passes = refuse
    try:
        return _rank_call(rank, b, loss_fn, 1 << 50, chunk_rows=480), messages
    finally:
        torch_backend.loss_inside_passes = original
        logging.getLogger("verl_fused_hook.ops.chunking").removeHandler(handler)


def tp_worker(rank, world_size):
    b = batch()
    plenty = 1 << 50
    out = {
        "groups": _rank_call(rank, b, gspo(b), plenty, chunk_rows=480, row_groups=b.row_groups),
        # rank 1 holds 500 rows, rank 0 any number: both walk rank 1's chunks
        "short on rank 1": _rank_call(
            rank,
            b,
            gspo(b),
            plenty if rank == 0 else _rank_room(rank, b, 500),
            chunk_rows=1000,
            row_groups=b.row_groups,
        ),
        # rank 1 holds less than the smallest chunk: both ranks take the two-pass path
        "no chunk on rank 1": _rank_call(
            rank,
            b,
            gspo(b),
            plenty if rank == 0 else _rank_room(rank, b, 127),
            chunk_rows=1000,
            row_groups=b.row_groups,
        ),
    }
    # without row groups (a token-separable loss): the same equal chunks of rank 1's 500 rows on both ranks
    loss_fn, _ = _weighted_sum(b.labels.numel())
    out["short on rank 1, no groups"] = _rank_call(
        rank, b, loss_fn, plenty if rank == 0 else _rank_room(rank, b, 500), chunk_rows=1000
    )
    other = b.row_groups.clone()
    other[b.index[2, 0] :] += 1  # rank 1 splits sequence 2 in two
    other[b.index[2, 0] : b.index[2, 25]] -= 1
    out["different groups"] = _rank_call(
        rank, b, gspo(b), plenty, chunk_rows=480, row_groups=b.row_groups if rank == 0 else other
    )
    out["allocation refused on rank 1"] = _refused_on(rank, 1, b, loss_fn)
    broken = b.row_groups.clone()
    broken[b.index[3, 10]] = 0
    out["broken on rank 1"] = _rank_call(
        rank, b, gspo(b), plenty, chunk_rows=480, row_groups=b.row_groups if rank == 0 else broken
    )
    return out


@pytest.fixture(scope="module")
def tp_ranks():
    from verl_fused_hook_harness.support.distributed import run_in_processes

    return run_in_processes(tp_worker, 2)


@pytest.mark.parametrize(
    "case, ends", [("groups", [400, 680, 1010]), ("short on rank 1", [400, 680, 1010]), ("no chunk on rank 1", [])]
)
def test_tp2_row_groups_match_the_two_pass_op(tp_ranks, case, ends):
    b = batch()
    loss, metrics, _, _, (want_dh, want_dw) = two_pass_reference(b, gspo(b))
    padded_dw = torch.cat([want_dw, torch.zeros(2 * SHARD - V, H)])
    for rank, per_rank in enumerate(tp_ranks):
        got_ends, got_loss, got_metrics, d_hidden, d_weight = per_rank[case]
        assert got_ends == ends, (rank, got_ends)  # the two-pass path evaluates the loss once: no per-chunk call
        torch.testing.assert_close(got_loss, loss, rtol=RTOL, atol=0)
        assert got_metrics == pytest.approx(metrics, rel=RTOL, abs=1e-7)
        assert float((d_hidden - want_dh).abs().max()) <= RTOL * float(want_dh.abs().max())
        shard = padded_dw[rank * SHARD : (rank + 1) * SHARD]
        assert float((d_weight - shard).abs().max()) <= RTOL * float(want_dw.abs().max())


def test_tp2_ranks_agree_on_chunks_sized_from_their_free_memory(tp_ranks):
    b = batch()
    loss_fn, _ = _weighted_sum(b.labels.numel())
    loss, _, _, _, (want_dh, want_dw) = two_pass_reference(b, loss_fn)
    for rank, per_rank in enumerate(tp_ranks):
        ends, got_loss, _, d_hidden, d_weight = per_rank["short on rank 1, no groups"]
        assert ends == [337, 674, 1010], (rank, ends)
        torch.testing.assert_close(got_loss, loss, rtol=RTOL, atol=0)
        assert float((d_hidden - want_dh).abs().max()) <= RTOL * float(want_dh.abs().max())


def test_tp2_a_buffer_one_rank_cannot_allocate_sends_every_rank_to_the_two_pass_path(tp_ranks):
    """Rank 1's allocator refuses its chunk buffer: both ranks run the two-pass path (their collectives must match),
    each saying why."""
    b = batch()
    loss_fn, _ = _weighted_sum(b.labels.numel())
    loss, _, _, _, (want_dh, want_dw) = two_pass_reference(b, loss_fn)
    padded_dw = torch.cat([want_dw, torch.zeros(2 * SHARD - V, H)])
    reasons = ["another rank of tp_group could not allocate its own", "CUDA out of memory. Tried to allocate 1.00 GiB."]
    for rank, per_rank in enumerate(tp_ranks):
        (ends, got_loss, _, d_hidden, d_weight), messages = per_rank["allocation refused on rank 1"]
        assert ends == [], (rank, ends)  # no chunk ran on either rank
        torch.testing.assert_close(got_loss, loss, rtol=RTOL, atol=0)
        assert float((d_hidden - want_dh).abs().max()) <= RTOL * float(want_dh.abs().max())
        shard = padded_dw[rank * SHARD : (rank + 1) * SHARD]
        assert float((d_weight - shard).abs().max()) <= RTOL * float(want_dw.abs().max())
        assert messages == [
            "log_probs_entropy_and_loss: loss gspo tp: the chunk of kept logits or the fp32 d_weight accumulator could "
            f"not be allocated ({reasons[rank]}); this call runs the two-pass path (logits recomputed in backward)"
        ]


def test_tp2_ranks_must_pass_the_same_row_groups(tp_ranks):
    for per_rank in tp_ranks:
        assert per_rank["different groups"] == (
            "row_groups: every rank of tp_group must pass the same row_groups (as the same rows); the ranks' groups "
            "of scored rows differ"
        )
    assert tp_ranks[1]["broken on rank 1"].startswith("row_groups: the scored rows of group 0 are not contiguous")
    assert tp_ranks[0]["broken on rank 1"] == (
        "row_groups: another rank of tp_group refused its row_groups (see its error); every rank must pass the same "
        "row_groups"
    )


def test_whole_sequences_are_packed_into_as_few_chunks_as_greedy_needs_and_cut_near_equal_shares():
    """32 sequences of 2048 rows in chunks of at most 13952 rows (the Triton passes' 4 GiB budget at V=151936):
    greedy packing needs six chunks and leaves two sequences for the last; the cuts nearest each sixth give
    5, 6, 5, 5, 6, 5 sequences. Where no such cut fits the capacity, greedy's chunks stay."""
    spans = chunking._packed(torch.full((32,), 2048), 13952)
    assert [(s.stop - s.start) // 2048 for s in spans] == [5, 6, 5, 5, 6, 5]
    assert spans[0].start == 0 and spans[-1].stop == 32 * 2048
    assert all(a.stop == b.start for a, b in zip(spans, spans[1:]))
    # 9, 1, 9 rows in chunks of 10: the cut nearest 9.5 is greedy's (9) (1, 9)
    assert chunking._packed(torch.tensor([9, 1, 9]), 10) == [slice(0, 9), slice(9, 19)]
    g = torch.Generator().manual_seed(3)
    for _ in range(500):  # whatever the lengths: every unit once, in order, whole, within the capacity, greedy's count
        lengths = torch.randint(1, 40, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g)
        capacity = int(lengths.max()) + int(torch.randint(0, 60, (1,), generator=g))
        spans = chunking._packed(lengths, capacity)
        ends = set(lengths.cumsum(0).tolist())
        assert spans[0].start == 0 and spans[-1].stop == int(lengths.sum())
        assert all(a.stop == b.start and a.stop in ends for a, b in zip(spans, spans[1:]))
        assert all(0 < s.stop - s.start <= capacity for s in spans)
        assert len(spans) == len(chunking._greedy(lengths.cumsum(0).numpy(), capacity))
    assert chunking._packed(torch.tensor([5]), 8) == [slice(0, 5)]
