"""The fused loss's Triton path (CUDA only): the forward kernel keeping a chunk's logits in fp16, the in-place
gradient pass over them, and `log_probs_entropy_and_loss` through both, against fp64.

Tolerances: the stored logits are fp16 differences to their tile's max, so each is within 2^-11 of its own
size (plus fp32 GEMM rounding); d_logits are rounded once to bf16 (2^-8 with margin); the op's log-probs
and entropy come from the unchanged fp32 statistics (5e-5) and its gradients are held to the Triton
backend's target (4e-3 relative, Frobenius).
"""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook.ops import log_probs_entropy_and_loss
from verl_fused_hook_harness.support.distributed import run_in_processes
from verl_fused_hook_harness.support.reference import reference_log_probs_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VALUE_TOL = 5e-5
GRAD_TOL = 4e-3


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs(n, h, v, seed, offset=0.0):
    """bf16 hidden and weight. With `offset`, added to every logit through one extra hidden unit, the other
    entries are multiples of 1/4 and 1/32: every product and partial sum is then exact in fp32 even near
    the offset, so what is measured is the kernels' handling of large logits, not the GEMM's rounding."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if not offset:
        hidden = torch.randn(n, h, device="cuda", generator=g)
        weight = torch.randn(v, h, device="cuda", generator=g) * h**-0.5 * 3
        return hidden.bfloat16(), weight.bfloat16(), g
    hidden = torch.randint(-4, 5, (n, h), device="cuda", generator=g) / 4
    weight = torch.randint(-3, 4, (v, h), device="cuda", generator=g) / 32
    hidden[:, 0], weight[:, 0] = 1.0, offset
    return hidden.bfloat16(), weight.bfloat16(), g


def _stored(hidden, weight, label_col, inv_temp, vocab):
    from verl_fused_hook.ops.arguments import build_problem
    from verl_fused_hook.ops.backends.triton_backend import FORWARD_CONFIG, StoredLogits, local_statistics

    n = hidden.shape[0]
    p = build_problem(
        hidden,
        weight,
        torch.zeros(n, dtype=torch.long, device="cuda"),
        temperature=1.0,
        tp_group=None,
        score_mask=None,
        ignore_index=-100,
        vocab_size=vocab,
        calculate_entropy=True,
        tile_rows=None,
    )
    pitch = -(-vocab // 8) * 8
    store = StoredLogits(
        torch.full((n, pitch), float("nan"), dtype=torch.float16, device="cuda")[:, :vocab],
        torch.empty(n, -(-vocab // FORWARD_CONFIG.block_n), device="cuda"),
        FORWARD_CONFIG.block_n,
    )
    stats = local_statistics(p, hidden, weight, label_col.int(), inv_temp, store)
    return stats, store


@pytest.mark.parametrize("n,vocab,offset", [(200, 5003, 0.0), (130, 32000, -1.0e4), (7, 151936, 0.0)])
def test_forward_kernel_keeps_the_logits(n, vocab, offset):
    from verl_fused_hook.ops.backends.triton_backend import FORWARD_CONFIG

    hidden, weight, g = _inputs(n, 256, vocab, seed=n, offset=offset)
    label_col = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    inv_temp = 1 / (torch.rand(n, device="cuda", generator=g) + 0.5)
    (row_max, _, _, label), store = _stored(hidden, weight, label_col, inv_temp, vocab)
    raw = hidden.double() @ weight.double().t()
    tile = FORWARD_CONFIG.block_n
    tile_index = torch.arange(vocab, device="cuda") // tile
    rebuilt = store.shifted.double() + store.tile_max.double()[:, tile_index]
    assert bool(torch.isfinite(store.shifted).all())
    assert bool((store.shifted <= 0).all())
    fp32_error = 1e-5 * (raw.abs().amax() + 1)  # the kernel's fp32 products
    assert ((rebuilt - raw).abs() <= 2.0**-11 * (raw - store.tile_max.double()[:, tile_index]).abs() + fp32_error).all()
    z = raw * inv_temp.double().unsqueeze(1)
    assert (row_max.double() - z.amax(dim=1)).abs().max().item() <= fp32_error * inv_temp.max().item()
    assert (label.double() - z.gather(1, label_col.unsqueeze(1)).squeeze(1)).abs().max() <= fp32_error * 2


@pytest.mark.parametrize("offset", [0.0, -1.0e4])
def test_gradient_pass_overwrites_the_stored_logits_with_d_logits(offset):
    from verl_fused_hook.ops.backends.triton_backend import stored_grad_logits

    n, vocab = 150, 20011
    hidden, weight, g = _inputs(n, 256, vocab, seed=3, offset=offset)
    label_col = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    label_col[::4] = -1  # labels on another tensor-parallel rank
    inv_temp = 1 / (torch.rand(n, device="cuda", generator=g) + 0.5)
    (row_max, total, dot, _), store = _stored(hidden, weight, label_col, inv_temp, vocab)
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    dz = stored_grad_logits(store, label_col, inv_temp, row_max, total.log(), dot / total, g_lp, g_ent, torch.bfloat16)
    assert dz.dtype == torch.bfloat16 and dz.data_ptr() == store.shifted.data_ptr()

    z = (hidden.double() @ weight.double().t()) * inv_temp.double().unsqueeze(1)
    p = torch.softmax(z, dim=1)
    mean = (p * z).sum(1, keepdim=True)
    onehot = torch.zeros_like(z)
    has = label_col >= 0
    onehot[has.nonzero().squeeze(1), label_col[has]] = 1.0
    ref = inv_temp.double().unsqueeze(1) * (
        g_lp.double().unsqueeze(1) * (onehot - p) + g_ent.double().unsqueeze(1) * p * (mean - z)
    )
    # bf16 output rounding, plus the fp16 storage and fp32 products, relative to the row's largest entry
    bound = 2.0**-8 * ref.abs() + 2e-3 * ref.abs().amax(dim=1, keepdim=True)
    assert bool(((dz.double() - ref).abs() <= bound).all()), (dz.double() - ref).abs().max().item()


def _weighted_sum(g_lp, g_ent):
    def loss_fn(log_probs, entropy):
        return (log_probs * g_lp).sum() + (entropy * g_ent).sum(), {"rows": int(log_probs.numel())}

    return loss_fn


@pytest.mark.parametrize("chunk_rows", [None, 128, 300])
def test_fused_loss_matches_fp64_over_chunks(chunk_rows):
    n, h, vocab = 700, 512, 5003
    hidden, weight, g = _inputs(n, h, vocab, seed=11)
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    labels[::7] = -100
    score_mask = torch.rand(n, device="cuda", generator=g) > 0.3
    temperature = torch.rand(n, device="cuda", generator=g) + 0.5
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    hid, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = log_probs_entropy_and_loss(
        hid,
        w,
        labels,
        loss_fn=_weighted_sum(g_lp, g_ent),
        loss_name="weighted sum",
        temperature=temperature,
        score_mask=score_mask,
        chunk_rows=chunk_rows,
    )
    out.loss.backward()
    active = score_mask & (labels != -100)
    ref = reference_log_probs_entropy(
        hidden, weight, labels.clamp(min=0), temperature=temperature, active=active, grad_outputs=(g_lp, g_ent)
    )
    assert (out.log_probs - ref[0]).abs().max().item() <= VALUE_TOL
    assert (out.entropy - ref[1]).abs().max().item() <= VALUE_TOL
    assert bool((out.log_probs[~active] == 0).all())
    assert _rel(hid.grad, ref[2]) <= GRAD_TOL
    assert _rel(w.grad, ref[3]) <= GRAD_TOL
    assert hid.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def _tp_worker(rank, world_size, hidden, weight, labels, g_lp, g_ent, vocab_size):
    import torch.distributed as dist

    shard = weight.shape[0] // world_size
    h = hidden.cuda().requires_grad_()
    w = weight[rank * shard : (rank + 1) * shard].cuda().requires_grad_()
    out = log_probs_entropy_and_loss(
        h,
        w,
        labels.cuda(),
        loss_fn=_weighted_sum(g_lp.cuda(), g_ent.cuda()),
        loss_name="weighted sum",
        temperature=0.8,
        tp_group=dist.group.WORLD,
        tp_hidden="partial",
        vocab_size=vocab_size,
        chunk_rows=128,
    )
    out.loss.backward()
    return out.log_probs.cpu(), out.entropy.cpu(), h.grad.float().cpu(), w.grad.float().cpu()


def test_fused_loss_tensor_parallel_two_ranks_on_one_gpu():
    n, h, v, vocab_size = 300, 512, 2 * 8008, 15990  # rank 1's shard ends in padding
    hidden, weight, g = _inputs(n, h, v, seed=31)
    labels = torch.randint(0, vocab_size, (n,), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    results = run_in_processes(
        _tp_worker, 2, hidden.cpu(), weight.cpu(), labels.cpu(), g_lp.cpu(), g_ent.cpu(), vocab_size
    )
    ref = reference_log_probs_entropy(
        hidden, weight, labels, temperature=0.8, vocab_size=vocab_size, grad_outputs=(g_lp, g_ent)
    )
    for lp, ent, *_ in results:
        assert (lp - ref[0].cpu()).abs().max().item() <= VALUE_TOL
        assert (ent - ref[1].cpu()).abs().max().item() <= VALUE_TOL
    d_hidden = sum(r[2] for r in results)  # the caller's all-reduce of the partial d_hidden
    d_weight = torch.cat([r[3] for r in results])
    assert _rel(d_hidden, ref[2].cpu()) <= GRAD_TOL
    assert _rel(d_weight, ref[3].cpu()) <= GRAD_TOL
    assert bool((d_weight[vocab_size:] == 0).all())
