"""The fused loss on a CUDA GPU short of memory, and with row groups (skipped without CUDA).

Another allocation holds most of the GPU: the chunk of stored logits is sized from what is left (no OOM,
more chunks, the same result within bf16 rounding), and when not even one row block of the forward kernel
fits the call takes the two-pass path and says so. Peak memory of each call stays within what was free.
Row groups: a GSPO-like sequence-level loss over sequences of very different lengths, chunks of whole
sequences, against the two-pass op plus autograd.
Run in a process of its own (`python -m pytest tests/gpu/test_fused_loss_memory_cuda.py`): the tests read the CUDA
caching allocator's state, and other modules run before them in one process leave free pieces cached (on the H200
1.0-1.4 GB) that their segments cannot be placed around.
"""

from __future__ import annotations

import logging

import pytest
import torch

from verl_fused_hook.ops import NonSeparableLossError, chunking, log_probs_and_entropy, log_probs_entropy_and_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N, H, V = 16384, 2048, 65536  # stored logits of every row: 2.0 GiB (one chunk at the 4 GiB budget); accumulator 0.5 GiB
GRAD_TOL = 1e-2  # bf16 gradients, chunked against one chunk (the fp32 accumulator adds one rounding's worth)


def _inputs(n=N, h=H, v=V, seed=8):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5 * 3).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g) / n, torch.randn(n, device="cuda", generator=g) / n
    return hidden, weight, labels, g_lp, g_ent


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _fixed_and_row(hidden, weight, labels):
    """What plan_chunks holds back beside the chunk (gradients, per-row vectors, margin), the fp32 d_weight
    accumulator, and the bytes per row of a chunk, for the backend "auto" picks."""
    from verl_fused_hook.ops.arguments import build_problem
    from verl_fused_hook.ops.backends import resolve_backend

    p = build_problem(
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
    )
    cost = resolve_backend("auto", p, driver="log_probs_entropy_and_loss").load().loss_inside_cost(p, True)
    fixed = (
        cost.fixed_bytes
        + chunking.ROW_VECTOR_BYTES * p.num_rows
        + chunking.FREE_MEMORY_MARGIN_BYTES
        + hidden.numel() * hidden.element_size()
        + weight.numel() * weight.element_size()
    )
    return fixed, 4 * weight.numel(), cost


def _run(hidden, weight, labels, g_lp, g_ent, **kwargs):
    """(chunk sizes, loss, d_hidden, d_weight, peak bytes above what was allocated before the call)."""
    sizes = []

    def row_gradients(rows, lp, ent):
        sizes.append(rows.numel())
        return g_lp[rows], g_ent[rows]

    x, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = log_probs_entropy_and_loss(
        x,
        w,
        labels,
        loss_fn=lambda lp, ent: ((lp * g_lp).sum() + (ent * g_ent).sum(), {}),
        loss_name="weighted sum",
        row_gradients=row_gradients,
        **kwargs,
    )
    d_hidden, d_weight = torch.autograd.grad(result.loss, (x, w))
    torch.cuda.synchronize()
    return sizes, result.loss.detach(), d_hidden, d_weight, torch.cuda.max_memory_allocated() - before


def _hold_all_but(room: int) -> torch.Tensor:
    """An allocation that leaves about `room` bytes of what the op can allocate."""
    torch.cuda.empty_cache()  # no cached fragments: what is free is one piece
    return torch.empty(max(0, chunking.available_bytes(torch.device("cuda")) - room), dtype=torch.uint8, device="cuda")


def test_free_memory_sizes_the_chunk():
    inputs = _inputs()
    fixed, accumulator, cost = _fixed_and_row(*inputs[:3])
    roomy_sizes, loss, d_hidden, d_weight, _ = _run(*inputs)
    assert roomy_sizes == [N]  # every row in one chunk: 2 GiB of stored logits at the 4 GiB budget
    hog = _hold_all_but(fixed + accumulator + 2**30)  # 1 GiB for the chunk
    try:
        available = chunking.available_bytes(torch.device("cuda"))
        sizes, short_loss, short_dh, short_dw, peak = _run(*inputs)
    finally:
        del hog
        torch.cuda.empty_cache()  # hand the held memory back: later tests spawn processes on this GPU
    fit = (available - fixed - accumulator) // cost.row_bytes
    print(f"free {available / 2**30:.2f} GiB: chunks {sizes} (fit {fit}), peak {peak / 2**30:.2f} GiB")
    assert len(sizes) >= 2 and max(sizes) <= fit and sum(sizes) == N
    assert peak <= available  # no OOM, by construction rather than by luck
    torch.testing.assert_close(short_loss, loss, rtol=1e-6, atol=0)
    assert _rel(short_dh, d_hidden) < GRAD_TOL and _rel(short_dw, d_weight) < GRAD_TOL


def _strand(size: int) -> torch.Tensor:
    """A new cached segment of `size` bytes split by a small allocation: the rest of it is free but not releasable
    ("inactive split"), usable only by requests that fit it. Returns the small allocation, sized just above every
    free piece already cached, so that the allocator's best fit takes it from the new segment."""
    torch.cuda.empty_cache()  # only pieces of segments in use stay cached
    pieces = [
        block["size"]
        for segment in torch.cuda.memory_snapshot()
        for block in segment["blocks"]
        if block["state"] == "inactive"
    ]
    kept = max(pieces, default=0) + 2 * 2**20
    assert kept <= size // 4, (
        f"the cache already holds a free piece of {max(pieces)} bytes: run this module in a process of its own"
    )
    segment = torch.empty(size, dtype=torch.uint8, device="cuda")
    del segment
    return torch.empty(kept, dtype=torch.uint8, device="cuda")


def test_stranded_cache_pieces_are_not_counted_as_free():
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    before = chunking.available_bytes(device)
    stranded_before = torch.cuda.memory_stats(device)["inactive_split_bytes.all.current"]
    piece = _strand(2**30)
    try:
        stranded = torch.cuda.memory_stats(device)["inactive_split_bytes.all.current"] - stranded_before
        after = chunking.available_bytes(device)
        kept = piece.numel()
    finally:
        del piece
        torch.cuda.empty_cache()
    assert abs(stranded - (2**30 - kept)) <= 2**20  # the segment's free rest
    assert abs((before - after) - 2**30) <= 2 * 2**20  # the whole segment is gone from what a chunk can get


def test_a_fragmented_cache_sizes_the_chunk_without_running_out_of_memory(caplog):
    """Room for a 1.5 GiB chunk, of which 1 GiB is a stranded cache piece: counting it would plan a chunk the
    allocator cannot give; the plan counts what can be allocated and every chunk runs."""
    inputs = _inputs()
    fixed, accumulator, cost = _fixed_and_row(*inputs[:3])
    _, loss, d_hidden, d_weight, _ = _run(*inputs)
    hog = _hold_all_but(fixed + accumulator + 3 * 2**29)
    piece = _strand(2**30)
    try:
        available = chunking.available_bytes(torch.device("cuda"))
        with caplog.at_level(logging.WARNING, logger="verl_fused_hook.ops.chunking"):
            sizes, short_loss, short_dh, short_dw, peak = _run(*inputs)
    finally:
        del hog, piece
        torch.cuda.empty_cache()
    fit = (available - fixed - accumulator) // cost.row_bytes
    print(f"counted {available / 2**30:.2f} GiB: chunks {sizes} (fit {fit}), peak {peak / 2**30:.2f} GiB")
    assert [r.getMessage() for r in caplog.records] == []  # neither out of memory nor a fallback
    assert len(sizes) >= 2 and max(sizes) <= fit and sum(sizes) == N
    torch.testing.assert_close(short_loss, loss, rtol=1e-6, atol=0)
    assert _rel(short_dh, d_hidden) < GRAD_TOL and _rel(short_dw, d_weight) < GRAD_TOL


def test_no_row_block_in_free_memory_takes_the_two_pass_path(caplog):
    inputs = _inputs()
    fixed, accumulator, cost = _fixed_and_row(*inputs[:3])
    _, loss, d_hidden, d_weight, _ = _run(*inputs)
    hog = _hold_all_but(fixed + accumulator + 100 * cost.row_bytes)  # less than one 128-row block
    try:
        with caplog.at_level(logging.WARNING, logger="verl_fused_hook.ops.chunking"):
            sizes, short_loss, short_dh, short_dw, _ = _run(*inputs)
    finally:
        del hog
        torch.cuda.empty_cache()  # hand the held memory back: later tests spawn processes on this GPU
    assert sizes == []  # no chunk: the two-pass path never asks for row gradients
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "too little free GPU memory for a chunk of 128 rows" in messages[0], messages
    assert "this call runs the two-pass path (logits recomputed in backward)" in messages[0]
    torch.testing.assert_close(short_loss, loss, rtol=1e-5, atol=0)
    assert _rel(short_dh, d_hidden) < GRAD_TOL and _rel(short_dw, d_weight) < GRAD_TOL


def _gspo_like(lengths, old, advantages):
    seq = torch.arange(len(lengths), device="cuda").repeat_interleave(torch.tensor(lengths, device="cuda"))
    count = torch.tensor(lengths, device="cuda", dtype=torch.float32)

    def loss_fn(lp, ent):
        mean = torch.zeros(len(lengths), device="cuda").index_add(0, seq, lp - old) / count
        ratio = (lp - lp.detach() + mean.detach()[seq]).clamp(max=10).exp()
        pg = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(0.8, 1.2))
        return (pg / count[seq]).sum() / len(lengths) - 0.01 * ent.mean(), {}

    return loss_fn


def test_row_groups_on_cuda():
    lengths = [300, 9000, 1200, 4000, 100, 2500, 7000, 700]  # 24800 rows
    n = sum(lengths)
    hidden, weight, labels, _, _ = _inputs(n=n)
    groups = torch.arange(len(lengths), device="cuda").repeat_interleave(torch.tensor(lengths, device="cuda"))
    with torch.no_grad():
        lp, _ = log_probs_and_entropy(hidden, weight, labels)
    g = torch.Generator(device="cuda").manual_seed(3)
    old = lp + 0.3 * torch.randn(n, device="cuda", generator=g)
    advantages = torch.randn(len(lengths), device="cuda", generator=g)[groups]
    loss_fn = _gspo_like(lengths, old, advantages)
    x, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    lp, ent = log_probs_and_entropy(x, w, labels)
    want_loss, _ = loss_fn(lp, ent)
    want = torch.autograd.grad(want_loss, (x, w))
    calls = []

    def recording(lp, ent):
        calls.append(int(lp.ne(0).sum()))
        return loss_fn(lp, ent)

    _, _, cost = _fixed_and_row(hidden, weight, labels)
    chunk_bytes = 10000 * cost.stored_row_bytes  # 10000 rows of stored logits: three chunks of whole sequences
    x, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    result = log_probs_entropy_and_loss(
        x, w, labels, loss_fn=recording, loss_name="gspo-like", chunk_bytes=chunk_bytes, row_groups=groups
    )
    got = torch.autograd.grad(result.loss, (x, w))
    ends = torch.tensor(lengths).cumsum(0).tolist()
    assert calls[:-1] == [9300, 17100, 24800], calls  # (300, 9000) (1200, 4000, 100, 2500) (7000, 700)
    assert all(end in ends for end in calls[:-1])
    torch.testing.assert_close(result.loss, want_loss.detach(), rtol=1e-4, atol=0)
    assert _rel(got[0], want[0]) < GRAD_TOL and _rel(got[1], want[1]) < GRAD_TOL
    with pytest.raises(NonSeparableLossError, match="loss gspo-like: its gradient in the log-prob of a row depends"):
        log_probs_entropy_and_loss(
            hidden.detach().requires_grad_(),
            weight,
            labels,
            loss_fn=loss_fn,
            loss_name="gspo-like",
            chunk_bytes=chunk_bytes,
        )


def test_the_cache_is_counted_only_when_the_driver_free_memory_is_short_of_enough():
    """available_bytes(device, enough): the driver's free memory alone when it reaches `enough` (no statistics
    read); below that, the cached segment PyTorch can hand back counts too, as without `enough`."""
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    block = torch.empty(2**30, dtype=torch.uint8, device=device)
    del block  # one whole cached segment of 1 GiB: reclaimable
    free = torch.cuda.mem_get_info(device)[0]
    try:
        assert chunking.available_bytes(device, enough=free) == free
        counted = chunking.available_bytes(device, enough=free + 1)
        assert counted == chunking.available_bytes(device)
        assert abs(counted - free - 2**30) <= 2 * 2**20
    finally:
        torch.cuda.empty_cache()
