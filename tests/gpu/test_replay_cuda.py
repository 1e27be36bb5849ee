"""`replayed_log_probs` on a CUDA GPU (skipped elsewhere), bf16 at a real vocabulary: given sets and sets computed in
the trainer (Triton's candidates), against fp64 logits masked to the same sets; every output and d_hidden row the same
bits alone or inside a batch with batch_invariant; no [N, V] tensor (the extra memory of a step far below one row of
fp32 logits per token).

Tolerances: the portable GEMM path's logits are cuBLAS's bf16 products accumulated in fp32 in its own blocking (1e-3
absolute at logits up to ~20 / T; 2.2e-4 and 3.9e-4 measured on the H100); Triton's gather-dot and the portable
batch-invariant path sum exact products in fp32 in a fixed order (2e-4); gradients 5e-3 relative (Frobenius): bf16
d_logits on the GEMM path, bf16 outputs everywhere.
Run: python -m pytest -q tests/gpu/test_replay_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook import replayed_log_probs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N, H, V = 1000, 4096, 151936
VALUE_TOL = {True: 1e-3, False: 2e-4}  # the portable GEMM path, the others
GRAD_TOL = 5e-3


def _inputs(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) * H**-0.5 * 4).bfloat16()
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    temperature = torch.rand(N, device="cuda", generator=g) + 0.5
    kept = torch.randint(0, V, (N, 64), device="cuda", generator=g)
    kept = torch.where(torch.rand(N, 64, device="cuda", generator=g) < 0.3, -1, kept)
    kept[:, 0] = labels
    sorted_ids = kept.sort(dim=1).values  # drop repeats
    repeat = torch.zeros_like(kept, dtype=torch.bool)
    repeat[:, 1:] = (sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)
    kept = torch.where(repeat, -1, sorted_ids)
    kept = torch.where(kept == labels.unsqueeze(1), -1, kept)
    kept = torch.cat([labels.unsqueeze(1), kept], 1)
    return hidden, weight, labels, temperature, kept


def _reference(hidden, weight, labels, temperature, kept, g_lp, g_ent):
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = hd @ wd.t() / temperature.double().unsqueeze(1)
    keep = torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter_(1, kept.clamp_min(0), kept >= 0)
    keep[torch.arange(N, device=z.device), kept.clamp_min(0)[:, 0]] = True
    log_softmax = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=1)
    lp = log_softmax.gather(1, labels.unsqueeze(1)).squeeze(1)
    ent = -(log_softmax.exp() * torch.where(keep, log_softmax, 0.0)).sum(1)
    dh, dw = torch.autograd.grad([lp, ent], (hd, wd), [g_lp.double(), g_ent.double()])
    return lp.detach(), ent.detach(), dh, dw


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("source", ["given", "computed"])
def test_values_and_gradients_against_fp64(source, batch_invariant, backend):
    """Triton's gather-dot kernels, and the portable chunks (GEMM, or fixed-order sums under batch_invariant)."""
    hidden, weight, labels, temperature, kept = _inputs()
    sets = {"kept_ids": kept} if source == "given" else {"top_k": 50, "top_p": 0.9}
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if source == "computed" and backend == "torch" and batch_invariant:  # the candidates' full-vocabulary pass
        with pytest.raises(ValueError, match="batch_invariant=True: on CUDA the portable backend"):
            replayed_log_probs(h, w, labels, temperature=temperature, batch_invariant=True, backend="torch", **sets)
        return
    out = replayed_log_probs(
        h, w, labels, temperature=temperature, batch_invariant=batch_invariant, backend=backend, **sets
    )
    g = torch.Generator(device="cuda").manual_seed(3)
    g_lp, g_ent = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)
    dh, dw = torch.autograd.grad([out.log_probs, out.entropy], (h, w), [g_lp, g_ent])
    want = _reference(hidden, weight, labels, temperature, out.kept_ids, g_lp, g_ent)
    gemm = backend == "torch" and not batch_invariant
    assert (out.log_probs.double() - want[0]).abs().max().item() <= VALUE_TOL[gemm]
    assert (out.entropy.double() - want[1]).abs().max().item() <= VALUE_TOL[gemm]
    assert _rel(dh, want[2]) <= GRAD_TOL and _rel(dw, want[3]) <= GRAD_TOL


@pytest.mark.parametrize("source", ["given", "computed"])
def test_a_rows_bits_do_not_depend_on_its_batch(source):
    hidden, weight, labels, temperature, kept = _inputs(seed=1)

    def run(rows):
        sets = {"kept_ids": kept[rows]} if source == "given" else {"top_k": 50, "top_p": 0.9}
        h = hidden[rows].clone().requires_grad_()
        out = replayed_log_probs(h, weight, labels[rows], temperature=temperature[rows], batch_invariant=True, **sets)
        (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
        return out.log_probs[-7:].detach(), out.entropy[-7:].detach(), out.kept_ids[-7:], h.grad[-7:]

    alone = run(torch.arange(7, device="cuda"))
    for count in (1, 100, 993):
        rows = torch.cat([torch.arange(7, 7 + count, device="cuda"), torch.arange(7, device="cuda")])
        inside = run(rows)
        width = max(alone[2].shape[1], inside[2].shape[1])  # the batch's widest set pads every row's
        pad = [torch.nn.functional.pad(ids, (0, width - ids.shape[1]), value=-1) for ids in (alone[2], inside[2])]
        assert torch.equal(*pad), count
        for a, b in zip(alone[:2] + alone[3:], inside[:2] + inside[3:]):
            assert torch.equal(a, b), count


def test_extra_memory_grows_by_the_sets_not_the_vocabulary():
    """Sets from a pool of 8192 ids (their union saturates): from 1000 to 8000 tokens a step's extra memory beyond
    its returned gradients grows by at most 256 bytes per kept id per token (the [N, k] int64 ids, their checks'
    sorts, the fp32 logits and their temporaries; 234 bytes measured on the H100), where one row of fp32 logits is
    600 KB: nothing grows with the vocabulary or the hidden size."""

    def extra(n):
        hidden, weight, labels, temperature, _ = _inputs(seed=2)
        g = torch.Generator(device="cuda").manual_seed(n)
        hidden = hidden[:1].expand(n, H) + torch.randn(n, H, device="cuda", generator=g).bfloat16()
        labels = torch.randint(0, 8192, (n,), device="cuda", generator=g)
        kept = torch.stack([torch.randperm(8192, device="cuda", generator=g)[:64] for _ in range(16)])
        kept = kept[torch.randint(0, 16, (n,), device="cuda", generator=g)]
        kept = torch.cat([labels.unsqueeze(1), torch.where(kept == labels.unsqueeze(1), -1, kept)], 1)
        h, w = hidden.detach().requires_grad_(), weight.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = replayed_log_probs(h, w, labels, kept_ids=kept)
        dh, dw = torch.autograd.grad([out.log_probs, out.entropy], (h, w), [torch.ones_like(out.log_probs)] * 2)
        peak = torch.cuda.max_memory_allocated() - base
        return peak - dh.numel() * 2 - dw.numel() * 2

    small, large = extra(1000), extra(8000)
    assert (large - small) / 7000 <= 256 * 65, (small, large)
