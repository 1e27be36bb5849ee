"""Batch invariance of the Triton paths on a CUDA GPU (skipped elsewhere): a row's log-prob and entropy with the same
bits whatever batch computes it, and gradients with the same bits run to run. Every comparison is bitwise.

Rows are probed alone and then first or last among other rows (N not a multiple of a tile), with other rows masked,
per-row temperatures, a padded vocabulary, kept logits for some rows, d_weight into megatron's main_grad, inside the
fused loss under different chunk plans, and over two TP ranks sharing the GPU (gloo); with the ops'
batch_invariant=True, and the log-prob op's rows also with its default (off): its forward writes each column tile's
partial apart and merges them in an order fixed by the width, whatever split layout the row count picked.
Run: python -m pytest -q tests/gpu/test_batch_invariance_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook.ops import log_probs_and_entropy, log_probs_entropy_and_loss
from verl_fused_hook_harness.support.distributed import run_in_processes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROBE = 777  # rows, as in the measurement that found the op batch-dependent (1.9e-6 at 4096 x 151936)


def _inputs(rows: int, h: int, v: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(rows, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    labels = torch.randint(0, v, (rows,), device="cuda", generator=g)
    temperature = torch.rand(rows, device="cuda", generator=g) * 0.8 + 0.4
    return hidden, weight, labels, temperature


def _values(hidden, weight, labels, temperature, where, batch_invariant=True, **options):
    lp, ent = log_probs_and_entropy(
        hidden, weight, labels, temperature=temperature, backend="triton", batch_invariant=batch_invariant, **options
    )
    return lp[where].detach(), ent[where].detach()


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["flag on", "default"])
@pytest.mark.parametrize("h,v,vocab_size", [(4096, 151936, None), (3584, 152064, 151936), (1024, 32003, None)])
def test_a_rows_values_do_not_depend_on_its_batch(h, v, vocab_size, batch_invariant):
    total = 9000 if h < 4096 else 6000
    hidden, weight, labels, temperature = _inputs(PROBE + total, h, v, seed=5)
    if vocab_size is not None:
        labels = labels % vocab_size
    probe = slice(0, PROBE)
    options = dict(vocab_size=vocab_size, batch_invariant=batch_invariant)
    alone = _values(hidden[probe], weight, labels[probe], temperature[probe], slice(None), **options)
    for count in (1, 247, 3001, total):
        rest = slice(PROBE, PROBE + count)
        first = [torch.cat([t[probe], t[rest]]) for t in (hidden, labels, temperature)]
        last = [torch.cat([t[rest], t[probe]]) for t in (hidden, labels, temperature)]
        mask = torch.arange(count + PROBE, device="cuda") % 3 != 0
        mask[-PROBE:] = True
        cases = {
            "first": _values(first[0], weight, *first[1:], slice(0, PROBE), **options),
            "last": _values(last[0], weight, *last[1:], slice(-PROBE, None), **options),
            "last, others masked": _values(last[0], weight, *last[1:], slice(-PROBE, None), score_mask=mask, **options),
        }
        for name, (lp, ent) in cases.items():
            assert torch.equal(lp, alone[0]) and torch.equal(ent, alone[1]), (count, name)


def test_kept_logits_and_main_grad_give_the_same_values():
    """Rows whose logits are kept for the backward, and the main_grad mode, compute the same forward values."""
    hidden, weight, labels, temperature = _inputs(PROBE + 2000, 2048, 65536, seed=6)
    probe = slice(-PROBE, None)
    batch = [torch.cat([t[PROBE:], t[:PROBE]]) for t in (hidden, labels, temperature)]
    alone = _values(hidden[:PROBE], weight, labels[:PROBE], temperature[:PROBE], slice(None))
    for keep in (1 << 40, 1000 * (2 * 65536 + 4 * 256)):  # every row kept; the first ~1000 rows kept
        h = batch[0].clone().requires_grad_(True)
        lp, ent = _values(h, weight.clone().requires_grad_(True), *batch[1:], probe, keep_logits_bytes=keep)
        assert torch.equal(lp, alone[0]) and torch.equal(ent, alone[1]), keep
    w = torch.nn.Parameter(weight.clone())
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
    lp, ent = _values(batch[0].clone().requires_grad_(True), w, *batch[1:], probe, gradient_accumulation_fusion=True)
    assert torch.equal(lp, alone[0]) and torch.equal(ent, alone[1])


@pytest.mark.parametrize("chunk_rows", [None, 1024, 256])
def test_the_fused_loss_computes_the_two_pass_values_whatever_its_chunks(chunk_rows):
    hidden, weight, labels, temperature = _inputs(5000, 4096, 151936, seed=7)
    two_pass = _values(hidden, weight, labels, temperature, slice(None))
    result = log_probs_entropy_and_loss(
        hidden.clone().requires_grad_(True),
        weight.clone().requires_grad_(True),
        labels,
        temperature=temperature,
        backend="triton",
        loss_fn=lambda lp, ent: ((lp - 0.01 * ent).mean(), {}),
        loss_name="lp",
        chunk_rows=chunk_rows,
        batch_invariant=True,
    )
    assert torch.equal(result.log_probs, two_pass[0]) and torch.equal(result.entropy, two_pass[1])


def test_gradients_are_bitwise_reproducible():
    hidden, weight, labels, temperature = _inputs(4000, 4096, 151936, seed=8)
    grads = []
    for _ in range(2):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        lp, ent = log_probs_and_entropy(h, w, labels, temperature=temperature, backend="triton")
        (lp.sum() - 0.1 * ent.sum()).backward()
        grads.append((h.grad, w.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_the_portable_backend_refuses_the_guarantee_on_cuda():
    """cuBLAS picks its kernels by shape: the portable backend cannot promise a row's bits, and says so."""
    hidden, weight, labels, temperature = _inputs(64, 256, 1000, seed=10)
    with pytest.raises(ValueError, match="batch_invariant=True: on CUDA the portable backend"):
        log_probs_and_entropy(hidden, weight, labels, temperature=temperature, backend="torch", batch_invariant=True)


def test_auto_says_why_it_finds_no_backend_for_the_guarantee():
    """fp32 inputs with the guarantee on a GPU: Triton takes bf16 only and the portable backend refuses it, so auto
    stops with both reasons instead of running without the guarantee."""
    hidden, weight, labels, temperature = _inputs(64, 256, 1000, seed=11)
    with pytest.raises(ValueError) as raised:
        log_probs_and_entropy(hidden.float(), weight.float(), labels, temperature=temperature, batch_invariant=True)
    assert str(raised.value) == (
        "backend='auto' found no backend that runs this call here (triton: hidden/weight must both be bfloat16, got "
        "torch.float32 and torch.float32; torch: batch_invariant=True: on CUDA the portable backend's cuBLAS GEMMs "
        "and torch reductions pick their kernels by shape, so a row's values depend on its batch; use backend triton "
        "(or verl, whose kernel is invariant))"
    )


def test_top_k_ties_at_the_boundary_take_the_lower_ids_in_any_batch():
    """400 columns with one logit (and one column above them) around a top_k of 8, V=151936 (the best-tiles
    selection): with the guarantee every row returns the column above and the 7 lowest tied ids, alone or among
    up to 20000 rows (torch.topk's CUDA kernel picks its algorithm by the row count)."""
    from verl_fused_hook.ops import token_log_probs

    g = torch.Generator(device="cuda").manual_seed(12)
    h, v = 256, 151936
    weight = (torch.randn(v, h, device="cuda", generator=g) * 1e-3).bfloat16()
    tied = torch.randperm(v - 256, device="cuda", generator=g)[:400] + 256  # none in the first tile
    weight[tied] = 0.05
    weight[3] = 0.1  # the clear maximum, in the first tile
    hidden = torch.rand(20000, h, device="cuda", generator=g).bfloat16() + 0.5
    labels = torch.zeros(20000, dtype=torch.long, device="cuda")
    expected = [3, *sorted(tied.tolist())[:7]]
    for rows in (1, 5, 700, 20000):
        out = token_log_probs(hidden[:rows], weight, labels[:rows], top_k=8, backend="triton", batch_invariant=True)
        assert out.top_ids[:5].tolist() == [expected] * min(rows, 5), rows


def _tp_worker(rank, world_size, hidden, weight, labels, temperature):
    import torch.distributed as dist

    shard = weight.cuda().chunk(world_size)[rank]
    hidden, labels, temperature = hidden.cuda(), labels.cuda(), temperature.cuda()

    def values(rows):
        lp, ent = log_probs_and_entropy(
            hidden[rows],
            shard,
            labels[rows],
            temperature=temperature[rows],
            tp_group=dist.group.WORLD,
            backend="triton",
            vocab_size=151930,
            batch_invariant=True,
        )
        return lp[-PROBE:].cpu(), ent[-PROBE:].cpu()

    alone = values(torch.arange(PROBE, device="cuda"))
    inside = [
        values(torch.cat([torch.arange(PROBE, PROBE + count, device="cuda"), torch.arange(PROBE, device="cuda")]))
        for count in (5, 1500)
    ]
    return alone, inside


def test_tensor_parallel_two_ranks_on_one_gpu():
    hidden, weight, labels, temperature = _inputs(PROBE + 1500, 2048, 151936, seed=9)
    labels = labels % 151930
    results = run_in_processes(_tp_worker, 2, hidden.cpu(), weight.cpu(), labels.cpu(), temperature.cpu())
    alone = results[0][0]
    for rank_alone, inside in results:
        assert torch.equal(rank_alone[0], alone[0]) and torch.equal(rank_alone[1], alone[1])
        for lp, ent in inside:
            assert torch.equal(lp, alone[0]) and torch.equal(ent, alone[1])
