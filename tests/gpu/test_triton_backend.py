"""The fused Triton backend against an fp64 reference on a CUDA GPU (skipped elsewhere).

Tolerances are the project's accuracy targets: log-prob and entropy max error
5e-5, gradient relative error (Frobenius) 4e-3, for bf16 inputs.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from verl_fused_hook.ops import backward_plan, log_probs_and_entropy
from verl_fused_hook.ops.arguments import LogProbProblem, build_problem, default_tile_rows
from verl_fused_hook.ops.backends import resolve_backend
from verl_fused_hook.ops.backends.triton_backend import GRAD_CONFIG
from verl_fused_hook_harness.support import compare
from verl_fused_hook_harness.support.distributed import run_in_processes
from verl_fused_hook_harness.support.reference import reference_log_probs_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# the gradient kernel's tile, which the backward plan cuts rows and columns into
GRAD_BLOCKS = dict(block_m=GRAD_CONFIG.block_m, block_n=GRAD_CONFIG.block_n)

VALUE_TOL = 5e-5
GRAD_TOL = 4e-3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs(n, h, v, *, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = (torch.randn(n, h, device="cuda", generator=g) * scale).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    return hidden, weight, g


def _within(out, ref, rel_tol):
    return bool(((out.double() - ref.double()).abs() <= VALUE_TOL + rel_tol * ref.double().abs()).all())


def _bf16_logit_grad_bound(hidden, weight, labels, temperature, g_lp, g_ent):
    """Elementwise bound on the d_hidden error that bf16 d_logits allow: each dz_j is rounded
    by at most 2^-9 of itself, and d_hidden itself is rounded to bf16 once (with margin)."""
    h, w = hidden.double(), weight.double()
    z = h @ w.t() / temperature
    p = torch.softmax(z, dim=-1)
    mean = (p * z).sum(-1, keepdim=True)
    onehot = torch.nn.functional.one_hot(labels, w.shape[0]).double()
    dz = (g_lp.double().unsqueeze(1) * (onehot - p) + g_ent.double().unsqueeze(1) * p * (mean - z)) / temperature
    return 2.0**-8 * (dz.abs() @ w.abs() + (dz @ w).abs())


def _check(
    hidden,
    weight,
    labels,
    *,
    temperature=1.0,
    vocab_size=None,
    score_mask=None,
    entropy=True,
    grads=True,
    rel_tol=0.0,
    hidden_grad_bound=False,
    keep_logits_bytes=0,
):
    active = labels != -100 if score_mask is None else (labels != -100) & score_mask
    h = hidden.clone().requires_grad_(grads)
    w = weight.clone().requires_grad_(grads)
    lp, ent = log_probs_and_entropy(
        h,
        w,
        labels,
        temperature=temperature,
        vocab_size=vocab_size,
        score_mask=score_mask,
        calculate_entropy=entropy,
        backend="triton",
        keep_logits_bytes=keep_logits_bytes,
    )
    g_lp = torch.randn_like(lp)
    g_ent = torch.randn_like(lp) if entropy else torch.zeros_like(lp)
    ref = reference_log_probs_entropy(
        hidden,
        weight,
        labels.clamp(min=0),
        temperature=temperature,
        vocab_size=vocab_size,
        active=active,
        grad_outputs=(g_lp, g_ent) if grads else None,
    )
    assert _within(lp, ref[0], rel_tol), compare.max_abs(lp, ref[0])
    assert bool((lp[~active] == 0).all())
    if entropy:
        assert _within(ent, ref[1], rel_tol), compare.max_abs(ent, ref[1])
    else:
        assert ent is None
    if grads:
        ((lp * g_lp).sum() + ((ent * g_ent).sum() if entropy else 0)).backward()
        if hidden_grad_bound:
            bound = _bf16_logit_grad_bound(hidden, weight, labels, temperature, g_lp, g_ent)
            assert bool(((h.grad.double() - ref[2]).abs() <= bound).all())
        else:
            assert _rel(h.grad, ref[2]) <= GRAD_TOL
        assert _rel(w.grad, ref[3]) <= GRAD_TOL
        assert bool((h.grad[~active] == 0).all())
        if vocab_size is not None:
            assert bool((w.grad[vocab_size:] == 0).all())
    return lp, ent


@pytest.mark.parametrize(
    "n,h,v,vocab_size",
    [
        (1, 256, 32003, None),
        (333, 896, 32003, None),
        (200, 3584, 152064, 151936),  # Megatron-padded vocabulary
        (129, 1000, 151936, None),  # H neither a power of two nor a multiple of the K tile
    ],
)
def test_matches_fp64_reference(n, h, v, vocab_size):
    hidden, weight, g = _inputs(n, h, v, seed=n + h)
    labels = torch.randint(0, vocab_size or v, (n,), device="cuda", generator=g)
    _check(hidden, weight, labels, temperature=0.7, vocab_size=vocab_size)


@pytest.mark.parametrize("keep", ["every row", "two row blocks"])
def test_keep_logits_matches_fp64_reference(keep, small_backward_budgets):
    """keep_logits_bytes: every scored row's logits kept (two GEMMs in the backward), or two 128-row blocks of them
    with the rest recomputed over row tiles and vocabulary chunks; Megatron-padded vocabulary, masked rows, T per
    row."""
    from verl_fused_hook.ops.backends import triton_backend

    n, h, v, vocab_size = 700, 512, 5003, 4999
    hidden, weight, g = _inputs(n, h, v, seed=59)
    labels = torch.randint(0, vocab_size, (n,), device="cuda", generator=g)
    score_mask = torch.rand(n, device="cuda", generator=g) > 0.2
    temperature = torch.rand(n, device="cuda", generator=g) + 0.5
    per_row = 2 * 5000 + 4 * 20  # fp16 logits at a pitch of 5000 columns, an fp32 max per 256-column tile
    keep_bytes = 1 << 40 if keep == "every row" else 300 * per_row
    _check(
        hidden,
        weight,
        labels,
        temperature=temperature,
        vocab_size=vocab_size,
        score_mask=score_mask,
        keep_logits_bytes=keep_bytes,
    )
    problem = build_problem(
        hidden,
        weight,
        labels,
        temperature=temperature,
        tp_group=None,
        score_mask=score_mask,
        ignore_index=-100,
        vocab_size=vocab_size,
        calculate_entropy=True,
        tile_rows=None,
        keep_logits_bytes=keep_bytes,
    )
    kept = triton_backend.two_pass_passes(problem, True).kept.shifted.shape[0]
    assert kept == (int(score_mask.sum()) if keep == "every row" else 256)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5, "per_row"])
def test_temperatures(temperature):
    hidden, weight, g = _inputs(300, 512, 32003, seed=7)
    labels = torch.randint(0, 32003, (300,), device="cuda", generator=g)
    if temperature == "per_row":
        temperature = torch.rand(300, device="cuda", generator=g) * 2 + 0.25
    _check(hidden, weight, labels, temperature=temperature)


def test_masks_and_ignore_index():
    hidden, weight, g = _inputs(517, 768, 50000, seed=11)
    labels = torch.randint(0, 50000, (517,), device="cuda", generator=g)
    labels[::7] = -100
    score_mask = torch.rand(517, device="cuda", generator=g) > 0.5
    _check(hidden, weight, labels, temperature=0.9, score_mask=score_mask)


def test_log_probs_only():
    hidden, weight, g = _inputs(257, 640, 32003, seed=13)
    labels = torch.randint(0, 32003, (257,), device="cuda", generator=g)
    _check(hidden, weight, labels, entropy=False)


@pytest.mark.parametrize("offset", [0.0, -1.0e4])
def test_extreme_logits(offset):
    """Logits spread over +-1e4 (and all near -1e4): built from one or two exact bf16 products
    per logit, so the fp64 reference sees the same logits the kernel accumulates. At
    |log p| ~ 2e4 an fp32 output is only good to ~1e-3, hence the relative term.

    With every logit near -1e4 the offset lives in one weight column, and d_hidden along
    it is sum_j dz_j * (-1e4) with sum_j dz_j = 0: bf16 d_logits leave ~2^-9 |dz| * 1e4
    there (as in any kernel that stores d_logits in bf16), so that case is checked
    against the bf16 rounding bound instead of the relative tolerance."""
    n, h, v = 128, 64, 4099
    g = torch.Generator(device="cuda").manual_seed(17)
    hidden = torch.zeros(n, h, device="cuda", dtype=torch.bfloat16)
    weight = torch.zeros(v, h, device="cuda", dtype=torch.bfloat16)
    hidden[:, 0] = torch.randn(n, device="cuda", generator=g).sign().bfloat16()
    weight[:, 0] = (torch.rand(v, device="cuda", generator=g) * 2e4 - 1e4).bfloat16()
    if offset:  # integer logits near the offset: every partial sum is exact in fp32
        weight[:, 0] = torch.randint(-256, 257, (v,), device="cuda", generator=g).bfloat16()
        hidden[:, 1] = 1.0
        weight[:, 1] = offset
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    lp, ent = _check(hidden, weight, labels, temperature=0.5, rel_tol=2.0**-22, hidden_grad_bound=bool(offset))
    assert bool(torch.isfinite(lp).all()) and bool(torch.isfinite(ent).all())


def test_no_grad_matches_grad_path():
    hidden, weight, g = _inputs(300, 512, 32003, seed=19)
    labels = torch.randint(0, 32003, (300,), device="cuda", generator=g)
    with torch.no_grad():
        lp0, ent0 = log_probs_and_entropy(hidden, weight, labels, temperature=0.7, backend="triton")
    lp1, ent1 = log_probs_and_entropy(hidden.requires_grad_(), weight, labels, temperature=0.7, backend="triton")
    assert torch.equal(lp0, lp1) and torch.equal(ent0, ent1)


@pytest.mark.parametrize("mask", ["none", "host", "ignored"])
def test_no_grad_forward_never_waits_for_the_gpu_before_its_kernel(mask):
    """Without gradients the op reads nothing from the GPU before it has queued its kernels (the labels' check is
    read after them, a host score_mask picks rows on the host): torch's sync debug mode raises on any read that
    waits for the stream. The values match the grad path, which reads first, bit for bit; rows labelled
    ignore_index (the one case that reads again, after the kernels) hold 0."""
    hidden, weight, g = _inputs(1000, 512, 32003, seed=29)
    labels = torch.randint(0, 32003, (1000,), device="cuda", generator=g)
    score_mask = None
    if mask == "host":
        score_mask = (torch.rand(1000, device="cuda", generator=g) > 0.3).cpu()
    elif mask == "ignored":
        labels[::9] = -100
    call = dict(temperature=0.7, backend="triton", score_mask=score_mask)
    want = log_probs_and_entropy(hidden.clone().requires_grad_(), weight, labels, **call)
    torch.cuda.synchronize()
    with torch.no_grad():
        try:
            torch.cuda.set_sync_debug_mode("error" if mask != "ignored" else "default")
            got = log_probs_and_entropy(hidden, weight, labels, **call)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b.detach())
    if mask == "ignored":
        assert torch.all(got[0][::9] == 0) and torch.all(got[1][::9] == 0)


def test_bitwise_deterministic():
    hidden, weight, g = _inputs(1000, 1024, 32003, seed=23)
    labels = torch.randint(0, 32003, (1000,), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(1000, device="cuda", generator=g), torch.randn(1000, device="cuda", generator=g)
    runs = []
    for _ in range(2):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        lp, ent = log_probs_and_entropy(h, w, labels, temperature=0.7, backend="triton")
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        runs.append((lp, ent, h.grad, w.grad))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_auto_picks_triton_on_cuda():
    hidden, weight, _ = _inputs(4, 256, 1000, seed=29)
    problem = LogProbProblem(
        hidden=hidden,
        weight=weight,
        labels=torch.zeros(4, dtype=torch.long, device="cuda"),
        temperature=1.0,
        active_rows=torch.arange(4, device="cuda"),
        vocab_start=0,
        valid_columns=1000,
        tp_group=None,
        tp_world_size=1,
        calculate_entropy=True,
        tile_rows=default_tile_rows(1000),
    )
    assert resolve_backend("auto", problem).name == "triton"
    float_problem = dataclasses.replace(problem, hidden=hidden.float(), weight=weight.float())
    assert resolve_backend("auto", float_problem).name == "torch"


def _tp_worker(rank, world_size, hidden, weight, labels, g_lp, g_ent, vocab_size, keep_logits_bytes=0):
    import torch.distributed as dist

    shard = weight.shape[0] // world_size
    h = hidden.cuda().requires_grad_()
    w = weight[rank * shard : (rank + 1) * shard].cuda().requires_grad_()
    lp, ent = log_probs_and_entropy(
        h,
        w,
        labels.cuda(),
        temperature=0.8,
        tp_group=dist.group.WORLD,
        tp_hidden="partial",
        vocab_size=vocab_size,
        backend="triton",
        keep_logits_bytes=keep_logits_bytes,
    )
    ((lp * g_lp.cuda()).sum() + (ent * g_ent.cuda()).sum()).backward()
    return lp.cpu(), ent.cpu(), h.grad.float().cpu(), w.grad.float().cpu()


# keep_logits_bytes: none; every row; 200 rows' worth of the shard's kept logits (one 128-row block kept)
@pytest.mark.parametrize("keep_logits_bytes", [0, 1 << 40, 200 * (2 * 16000 + 4 * 63)])
def test_tensor_parallel_two_ranks_on_one_gpu(keep_logits_bytes):
    n, h, v, vocab_size = 300, 512, 2 * 16000, 31990  # rank 1's shard ends in padding
    hidden, weight, g = _inputs(n, h, v, seed=31)
    labels = torch.randint(0, vocab_size, (n,), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    results = run_in_processes(
        _tp_worker, 2, hidden.cpu(), weight.cpu(), labels.cpu(), g_lp.cpu(), g_ent.cpu(), vocab_size, keep_logits_bytes
    )
    ref = reference_log_probs_entropy(
        hidden, weight, labels, temperature=0.8, vocab_size=vocab_size, grad_outputs=(g_lp, g_ent)
    )
    d_hidden = sum(r[2] for r in results)  # the caller's all-reduce of the partial d_hidden
    d_weight = torch.cat([r[3] for r in results])
    for lp, ent, *_ in results:
        assert compare.max_abs(lp, ref[0].cpu()) <= VALUE_TOL
        assert compare.max_abs(ent, ref[1].cpu()) <= VALUE_TOL
    assert _rel(d_hidden, ref[2].cpu()) <= GRAD_TOL
    assert _rel(d_weight, ref[3].cpu()) <= GRAD_TOL
    assert bool((d_weight[vocab_size:] == 0).all())


@pytest.fixture
def small_backward_budgets(monkeypatch):
    """Budgets small enough that a few hundred rows take several row tiles and vocabulary chunks: the
    long-context tiling, checked against fp64 at a size the reference can afford."""

    monkeypatch.setattr(backward_plan, "CHUNK_COLUMNS", 1024)
    monkeypatch.setattr(backward_plan, "TILE_MEMORY_BUDGET", 1)  # every tile one block of rows
    monkeypatch.setattr(backward_plan, "SMALL_WALK_TILE_BYTES", 1)  # no wide chunks for these few rows
    tiling = backward_plan.backward_tiling(700, 512, 5003, 128, 128, 132)
    # six tiles of one row block each: every launch is one wave, so the widest chunk (fewest launches) is taken,
    # and the walk's chunks are widened ones with a ragged last
    assert len(tiling.tiles(700)) == 6 and tiling.columns == 1280 and 5003 % 1280


def test_row_tiled_backward_matches_fp64(small_backward_budgets):
    hidden, weight, g = _inputs(700, 512, 5003, seed=37)
    labels = torch.randint(0, 5003, (700,), device="cuda", generator=g)
    score_mask = torch.rand(700, device="cuda", generator=g) > 0.2
    temperature = torch.rand(700, device="cuda", generator=g) + 0.5
    _check(hidden, weight, labels, temperature=temperature, score_mask=score_mask)


def _tiled_tp_worker(rank, world_size, hidden, weight, labels, g_lp, g_ent, vocab_size, group_rows):

    backward_plan.CHUNK_COLUMNS = 1024
    backward_plan.TILE_MEMORY_BUDGET = 1
    backward_plan.SMALL_WALK_TILE_BYTES = 1
    backward_plan.ROW_GROUP_ROWS = group_rows
    backward_plan.GROUPS_MIN_SAVING_BYTES = 0  # groups wherever they need less memory at all
    shard = weight.shape[0] // world_size
    valid = min(shard, vocab_size - rank * shard)
    groups = len(backward_plan.row_groups(hidden.shape[0], hidden.shape[1], valid, True, True, **GRAD_BLOCKS))
    return groups, *_tp_worker(rank, world_size, hidden, weight, labels, g_lp, g_ent, vocab_size)


# The vocabulary walked outside (a 3000-column shard), or groups of 256 rows walked outside (a 100-column shard;
# rank 1's ends in padding): three groups on each rank.
@pytest.mark.parametrize("v, vocab_size, groups", [(2 * 3000, 5990, 1), (2 * 100, 190, 3)])
def test_row_tiled_backward_tensor_parallel(v, vocab_size, groups):
    n, h = 600, 256
    hidden, weight, g = _inputs(n, h, v, seed=41)
    labels = torch.randint(0, vocab_size, (n,), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    results = run_in_processes(
        _tiled_tp_worker, 2, hidden.cpu(), weight.cpu(), labels.cpu(), g_lp.cpu(), g_ent.cpu(), vocab_size, 256
    )
    ref = reference_log_probs_entropy(
        hidden, weight, labels, temperature=0.8, vocab_size=vocab_size, grad_outputs=(g_lp, g_ent)
    )
    assert [r[0] for r in results] == [groups, groups]
    for _, lp, ent, *_ in results:
        assert compare.max_abs(lp, ref[0].cpu()) <= VALUE_TOL
        assert compare.max_abs(ent, ref[1].cpu()) <= VALUE_TOL
    assert _rel(sum(r[3] for r in results), ref[2].cpu()) <= GRAD_TOL
    assert _rel(torch.cat([r[4] for r in results]), ref[3].cpu()) <= GRAD_TOL
    assert bool((results[1][4][vocab_size - v // 2 :] == 0).all())


@pytest.mark.parametrize("n, h, v, groups", [(131072, 4096, 248320, 1), (98304, 4096, 16384, 3)])
def test_long_context_against_fp64_rows_and_row_chunks(n, h, v, groups):
    """N*H far past where the old backward narrowed its chunks: 131072 x 4096, V=248320 (the vocabulary walked
    outside), and 98304 rows over a 16384-column shard (a tensor-parallel shard at long context: three groups
    of rows walked outside, d_weight summed over them in fp32). A full fp64 reference does not fit, so: sampled
    rows' log-probs, entropy and d_hidden against fp64 (a row's values depend on that row alone), and d_weight
    against the fp64 sum of the op's d_weight over row chunks small enough to take one tile each (the
    short-context path the other tests hold to fp64)."""
    from verl_fused_hook.ops.backends import triton_backend

    grad = triton_backend.GRAD_CONFIG
    assert len(backward_plan.backward_tiling(n, h, v, grad.block_m, grad.block_n, 132).tiles(n)) > 1
    assert len(backward_plan.row_groups(n, h, v, True, True, **GRAD_BLOCKS)) == groups
    hidden, weight, g = _inputs(n, h, v, seed=43)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    hd, wd = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(hd, wd, labels, temperature=0.7, backend="triton")
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()

    rows = torch.randperm(n, device="cuda", generator=g)[:128]
    ref = reference_log_probs_entropy(
        hidden[rows], weight, labels[rows], temperature=0.7, grad_outputs=(g_lp[rows], g_ent[rows])
    )
    assert compare.max_abs(lp[rows], ref[0]) <= VALUE_TOL
    assert compare.max_abs(ent[rows], ref[1]) <= VALUE_TOL
    assert _rel(hd.grad[rows], ref[2]) <= GRAD_TOL
    del ref

    pieces = torch.zeros(v, h, dtype=torch.float64, device="cuda")
    chunk = 16384
    assert len(backward_plan.backward_tiling(chunk, h, v, grad.block_m, grad.block_n, 132).tiles(chunk)) == 1
    assert len(backward_plan.row_groups(chunk, h, v, True, True, **GRAD_BLOCKS)) == 1
    for start in range(0, n, chunk):
        part = slice(start, start + chunk)
        w = weight.clone().requires_grad_()
        lp_c, ent_c = log_probs_and_entropy(hidden[part], w, labels[part], temperature=0.7, backend="triton")
        ((lp_c * g_lp[part]).sum() + (ent_c * g_ent[part]).sum()).backward()
        pieces += w.grad.double()
        del w
    assert _rel(wd.grad, pieces) <= GRAD_TOL
