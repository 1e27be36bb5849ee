"""`token_log_probs` on a CUDA GPU (skipped elsewhere), Triton backend, bf16: against fp64 at shapes with N not a
multiple of a tile, masked rows, per-row temperatures and a padded vocabulary; two TP ranks sharing the GPU (gloo)
with ids on the other rank's shard; every output bitwise the same for a row alone or inside a batch; the extra memory
flat in N beyond per-row vectors.

Tolerances: values are fp32 sums of exact bf16 products (2e-4 absolute over 151936 columns); gradients go through
bf16 d_logits, the k + 1 sparse entries per row rounded twice (5e-3 relative, Frobenius).
Run: python -m pytest -q tests/gpu/test_selected_tokens_cuda.py
"""

from __future__ import annotations

import pytest
import torch
from selected_tokens_cases import make_case, max_abs, reference, rel, run_case, scored_rows, upstream_loss

from verl_fused_hook.ops import token_log_probs
from verl_fused_hook_harness.support.distributed import run_in_processes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VALUE_TOL = 2e-4
GRAD_TOL = 5e-3
TOP_K = 32


def _run(case, top_k=TOP_K, **options):
    return run_case(case, top_k=top_k, calculate_sum_pi_squared=True, backend="triton", **options)


def _check_top(out, want_log_softmax_rows, case):
    """top_log_probs are the fp64 top values; each returned id's fp64 log-prob is its returned log-prob (ids exact up
    to ties within the tolerance)."""
    active = scored_rows(case)
    values, _ = want_log_softmax_rows.topk(TOP_K, dim=1)
    assert max_abs(out.top_log_probs[active], values) <= VALUE_TOL
    assert max_abs(want_log_softmax_rows.gather(1, out.top_ids[active]), out.top_log_probs[active]) <= VALUE_TOL
    assert (out.top_ids[~active] == -1).all()


@pytest.mark.parametrize("n,h,padded,vocab,k", [(777, 4096, 151936, 151930, 128), (1000, 1024, 32008, 32003, 32)])
def test_against_fp64(n, h, padded, vocab, k):
    case = make_case(
        n=n, h=h, padded=padded, vocab=vocab, k=k, dtype=torch.bfloat16, device="cuda", weight_scale=h**-0.5
    )
    want = reference(case)
    out, d_hidden, d_weight = _run(case)
    for name in ("log_probs", "entropy", "token_log_probs", "sum_pi_squared"):
        assert max_abs(getattr(out, name), want[name]) <= VALUE_TOL, name
    assert rel(d_hidden, want["d_hidden"]) <= GRAD_TOL and rel(d_weight, want["d_weight"]) <= GRAD_TOL
    assert torch.count_nonzero(d_hidden[~scored_rows(case)]) == 0
    with torch.no_grad():
        t = case.temperature.double().unsqueeze(1)
        log_softmax = torch.log_softmax(case.hidden.double() @ case.weight[:vocab].double().t() / t, dim=1)
    _check_top(out, log_softmax[scored_rows(case)], case)


def _tp_worker(rank, world_size):
    import torch.distributed as dist

    case = make_case(
        n=501,
        h=1024,
        padded=32008,
        vocab=32003,
        k=64,
        tp=world_size,
        dtype=torch.bfloat16,
        device="cuda",
        weight_scale=1024**-0.5,
    )
    shard = case.weight.chunk(world_size)[rank].clone().requires_grad_()
    hidden = case.hidden.clone().requires_grad_()
    out = token_log_probs(
        hidden,
        shard,
        case.labels,
        case.token_ids,
        temperature=case.temperature,
        tp_group=dist.group.WORLD,
        score_mask=case.score_mask,
        vocab_size=case.vocab_size,
        top_k=TOP_K,
        calculate_sum_pi_squared=True,
        backend="triton",
    )
    upstream_loss(out, case).backward()
    return {name: value.cpu() for name, value in out._asdict().items()}, hidden.grad.cpu(), shard.grad.cpu()


def test_tensor_parallel_two_ranks_on_one_gpu():
    results = run_in_processes(_tp_worker, 2)
    case = make_case(
        n=501, h=1024, padded=32008, vocab=32003, k=64, tp=2, dtype=torch.bfloat16, weight_scale=1024**-0.5
    )
    want = reference(case, top_k=TOP_K)
    outputs, d_hiddens, d_weights = zip(*results)
    for name, value in outputs[0].items():
        assert torch.equal(outputs[1][name], value), f"ranks must agree on {name}"
        if name != "top_ids":
            assert max_abs(value, want[name]) <= VALUE_TOL, name
    for d_hidden in d_hiddens:
        assert rel(d_hidden, want["d_hidden"]) <= GRAD_TOL
    assert rel(torch.cat(d_weights), want["d_weight"]) <= GRAD_TOL


def test_every_output_of_a_row_is_the_same_alone_and_in_a_batch():
    case = make_case(
        n=3777,
        h=4096,
        padded=151936,
        vocab=151930,
        k=128,
        dtype=torch.bfloat16,
        device="cuda",
        weight_scale=4096**-0.5,
        masked=False,
    )
    probe = slice(3000, 3777)

    def outputs(rows, mask=None, chunk_bytes=None):
        with torch.no_grad():
            out = token_log_probs(
                case.hidden[rows],
                case.weight,
                case.labels[rows],
                case.token_ids[rows],
                temperature=case.temperature[rows],
                vocab_size=case.vocab_size,
                score_mask=mask,
                top_k=128,
                calculate_sum_pi_squared=True,
                backend="triton",
                batch_invariant=True,
                top_k_chunk_bytes=chunk_bytes,
            )
        return out

    alone = outputs(probe)
    for rows in (
        torch.arange(0, 3777, device="cuda"),
        torch.cat([torch.arange(3000, 3777), torch.arange(0, 5)]).cuda(),
    ):
        mask = torch.ones(rows.numel(), dtype=torch.bool, device="cuda")
        mask[torch.arange(rows.numel(), device="cuda") % 3 == 0] = False
        probed = (rows >= 3000).nonzero().squeeze(1)
        mask[probed] = True
        # default chunks (1408 rows), and one row block a chunk (64 MiB: 128 rows)
        for batch in (outputs(rows), outputs(rows, mask), outputs(rows, chunk_bytes=64 * 1024**2)):
            for name, value in alone._asdict().items():
                assert torch.equal(getattr(batch, name)[probed], value), name


def test_extra_memory_is_flat_in_rows():
    """Peak memory beyond inputs and returned gradients, forward+backward with k = top_k = 128, at two row counts:
    it may grow by the per-row vectors ([N, k] ids' columns, coefficients and outputs, 64 (k + 1) bytes a row) and the
    fp32 d_hidden sum with its rounding (6 H), nothing with the vocabulary (full logits: 2 V bytes a row)."""
    h, v, k = 4096, 151936, 128
    extra = {}
    for n in (16384, 65536):
        g = torch.Generator(device="cuda").manual_seed(n)
        hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
        weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).bfloat16().requires_grad_()
        labels = torch.randint(0, v, (n,), device="cuda", generator=g)
        ids = torch.randint(0, v, (n, k), device="cuda", generator=g)
        coefficients = torch.randn(n, k, device="cuda", generator=g)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = token_log_probs(
            hidden,
            weight,
            labels,
            ids,
            temperature=0.7,
            calculate_log_probs=False,
            calculate_entropy=False,
            top_k=k,
            backend="triton",
        )
        grads = torch.autograd.grad((out.token_log_probs * coefficients).sum(), (hidden, weight))
        torch.cuda.synchronize()
        extra[n] = torch.cuda.max_memory_allocated() - base - sum(g.numel() * g.element_size() for g in grads)
        del out, grads, hidden, weight
        torch.cuda.empty_cache()
    growth = extra[65536] - extra[16384]
    assert growth <= (65536 - 16384) * (64 * (k + 1) + 6 * h), extra
