"""The op on one rank against an independent fp64 reference (CPU, torch backend)."""

import logging

import pytest
import torch
from saved_tensors import SavedTensorBytes

from verl_fused_hook import log_probs_and_entropy
from verl_fused_hook_harness.support import compare
from verl_fused_hook_harness.support.memory import PeakMemory
from verl_fused_hook_harness.support.reference import reference_log_probs_entropy

FP32_ATOL = 1e-5  # log-prob / entropy, fp32 inputs
FP32_GRAD_RTOL = 1e-5  # gradients, relative to the reference's largest entry
BF16_ATOL = 2e-3  # log-prob / entropy against fp64 on the same bf16 values
BF16_GRAD_RTOL = 1e-2  # bf16 gradients carry bf16's own rounding (2^-8)


def make_inputs(n=53, h=48, v=1000, dtype=torch.float32, seed=0, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=generator) * scale).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=generator) * 0.3).to(dtype).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=generator)
    grads = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    return hidden, weight, labels, grads


def run_op(hidden, weight, labels, grads, **kwargs):
    log_probs, entropy = log_probs_and_entropy(hidden, weight, labels, backend="torch", **kwargs)
    (log_probs * grads[0] + entropy * grads[1]).sum().backward()
    return log_probs, entropy, hidden.grad, weight.grad


def assert_matches(got, want, atol, grad_rtol):
    (lp, ent, dh, dw), (rlp, rent, rdh, rdw) = got, want
    assert compare.max_abs(lp, rlp) <= atol, f"log_probs off by {compare.max_abs(lp, rlp):.3g}"
    assert compare.max_abs(ent, rent) <= atol, f"entropy off by {compare.max_abs(ent, rent):.3g}"
    d_hidden_error, d_weight_error = compare.error(rdh, dh, relative=True), compare.error(rdw, dw, relative=True)
    assert d_hidden_error <= grad_rtol, f"d_hidden off by {d_hidden_error:.3g} (relative)"
    assert d_weight_error <= grad_rtol, f"d_weight off by {d_weight_error:.3g} (relative)"


@pytest.mark.parametrize("temperature", [0.7, 1.3, "per_row"])
@pytest.mark.parametrize("tile_rows", [16, None])  # 53 rows: uneven last tile, and one tile
def test_fp32_matches_fp64(temperature, tile_rows):
    hidden, weight, labels, grads = make_inputs()
    if temperature == "per_row":
        temperature = torch.rand(labels.shape, generator=torch.Generator().manual_seed(1)) + 0.5
    got = run_op(hidden, weight, labels, grads, temperature=temperature, tile_rows=tile_rows)
    want = reference_log_probs_entropy(hidden, weight, labels, temperature=temperature, grad_outputs=grads)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert_matches(got, want, FP32_ATOL, FP32_GRAD_RTOL)


def test_bf16_inputs_computed_in_fp32():
    hidden, weight, labels, grads = make_inputs(dtype=torch.bfloat16)
    got = run_op(hidden, weight, labels, grads, temperature=0.7, tile_rows=16)
    want = reference_log_probs_entropy(hidden, weight, labels, temperature=0.7, grad_outputs=grads)
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    assert_matches(got, want, BF16_ATOL, BF16_GRAD_RTOL)


def test_vocab_that_divides_nothing_and_padding():
    # 32003 real ids inside a 32008-column weight: the 5 padded columns leave the softmax.
    hidden, weight, labels, grads = make_inputs(n=37, h=40, v=32008)
    labels = labels.clamp(max=32002)
    got = run_op(hidden, weight, labels, grads, temperature=1.3, vocab_size=32003, tile_rows=8)
    want = reference_log_probs_entropy(hidden, weight, labels, temperature=1.3, vocab_size=32003, grad_outputs=grads)
    assert_matches(got, want, 5e-5, FP32_GRAD_RTOL)  # entropy ~10.4 summed over 32003 columns in fp32
    assert torch.count_nonzero(got[3][32003:]) == 0


def test_ignore_index_and_score_mask_rows_are_skipped():
    hidden, weight, labels, grads = make_inputs()
    labels[[0, 5, 9]] = -100
    score_mask = torch.ones_like(labels, dtype=torch.bool)
    score_mask[10:30] = False
    active = (labels != -100) & score_mask
    got = run_op(hidden, weight, labels, grads, score_mask=score_mask, tile_rows=7)
    want = reference_log_probs_entropy(hidden, weight, labels, active=active, grad_outputs=grads)
    assert_matches(got, want, FP32_ATOL, FP32_GRAD_RTOL)
    assert torch.all(got[0][~active] == 0) and torch.all(got[1][~active] == 0)
    assert torch.all(got[2][~active] == 0)


@pytest.mark.parametrize("present", [True, False], ids=["ignored rows", "ignore_index unused"])
def test_an_ignore_index_inside_the_vocabulary(present):
    """The label checks read the labels' min and max; an ignore_index between them takes the exact check: rows with
    that label are skipped (zeros), the others match fp64; unused, every row is computed."""
    hidden, weight, labels, grads = make_inputs()
    labels[labels == 7] = 8
    if present:
        labels[[2, 11, 40]] = 7
    active = labels != 7
    got = run_op(hidden, weight, labels, grads, ignore_index=7)
    want = reference_log_probs_entropy(hidden, weight, labels, active=active, grad_outputs=grads)
    assert_matches(got, want, FP32_ATOL, FP32_GRAD_RTOL)
    assert int(active.sum()) == (50 if present else 53)
    assert torch.all(got[0][~active] == 0) and torch.all(got[2][~active] == 0)


def test_bad_label_values_among_ignored_rows_and_bad_row_temperatures_name_the_field():
    hidden, weight, labels, _ = make_inputs()
    bad = labels.clone()
    bad[[0, 5]] = -100  # ignored rows take the second read, which must still find the bad id
    bad[9] = 1000
    with pytest.raises(ValueError, match=r"labels: ids must lie in \[0, 1000\) or equal ignore_index=-100, found 1000"):
        log_probs_and_entropy(hidden, weight, bad)
    for value in (0.0, float("nan"), -1.0):
        temperature = torch.full(labels.shape, 0.8)
        temperature[3] = value
        with pytest.raises(ValueError, match="temperature: every value must be finite and > 0"):
            log_probs_and_entropy(hidden, weight, labels, temperature=temperature)


def test_without_gradients_the_labels_are_checked_after_the_kernels(caplog):
    """No graph: the op launches before it reads the labels (arguments.PendingLabelCheck). Rows labelled ignore_index
    are then computed and zeroed, with a log line; the rows scored keep the bits of the path that reads first (the
    torch backend on the CPU is batch invariant); a host score_mask picks rows without a read; a bad id (past the
    vocabulary too, where a gather would fault) still names the field."""
    caplog.set_level(logging.DEBUG, logger="verl_fused_hook")
    hidden, weight, labels, _ = make_inputs()
    labels[[0, 5, 9]] = -100
    labels[40:45] = (hidden[40:45] @ weight.t()).argmax(dim=1)  # scored rows whose label is the maximum
    score_mask = torch.ones_like(labels, dtype=torch.bool)
    score_mask[10:30] = False
    active = (labels != -100) & score_mask
    checked_first = log_probs_and_entropy(
        hidden, weight, labels, backend="torch", score_mask=score_mask, return_label_is_max=True
    )
    with torch.no_grad():
        checked_after = log_probs_and_entropy(
            hidden, weight, labels, backend="torch", score_mask=score_mask, return_label_is_max=True
        )
    assert "rows labelled ignore_index=-100 were computed too, then zeroed" in caplog.text
    for first, after in zip(checked_first, checked_after, strict=True):
        assert torch.equal(first.detach(), after), "a scored row's bits changed with the check's place"
    assert torch.all(checked_after[0][~active] == 0) and torch.all(checked_after[1][~active] == 0)
    assert not checked_after[2][~active].any() and checked_after[2][40:45].all()
    want = reference_log_probs_entropy(hidden, weight, labels, active=active)
    assert compare.max_abs(checked_after[0], want[0]) <= FP32_ATOL
    for bad_id in (1000, 10**9, -5):
        bad = labels.clone()
        bad[20] = bad_id  # a masked row: the check covers every label, as the one before the kernels does
        with torch.no_grad(), pytest.raises(ValueError, match=rf"labels: ids must lie in \[0, 1000\) .*found {bad_id}"):
            log_probs_and_entropy(hidden, weight, bad, backend="torch", score_mask=score_mask)


def test_no_rows_gives_empty_outputs():
    hidden, weight, labels, _ = make_inputs(n=0)
    log_probs, entropy = log_probs_and_entropy(hidden, weight, labels, backend="torch")
    assert log_probs.shape == (0,) and entropy.shape == (0,)


def test_all_rows_masked_gives_zeros_and_zero_gradients():
    hidden, weight, labels, grads = make_inputs()
    lp, ent, dh, dw = run_op(hidden, weight, labels, grads, score_mask=torch.zeros_like(labels, dtype=torch.bool))
    assert torch.all(lp == 0) and torch.all(ent == 0)
    assert torch.all(dh == 0) and torch.all(dw == 0)


def test_skipped_rows_cost_no_matmul():
    hidden, weight, labels, grads = make_inputs(n=64)
    score_mask = torch.arange(64) % 4 == 0
    rows_multiplied = []
    original = torch.Tensor.__matmul__

    def counting_matmul(a, b):
        if b.shape[-1] == weight.shape[0]:  # the logits GEMM: [rows, H] @ [H, V]
            rows_multiplied.append(a.shape[0])
        return original(a, b)

    torch.Tensor.__matmul__ = counting_matmul
    try:
        run_op(hidden, weight, labels, grads, score_mask=score_mask, tile_rows=8)  # whole padded blocks: 2 tiles of 8
    finally:
        torch.Tensor.__matmul__ = original
    assert sum(rows_multiplied) == 2 * 16  # 16 scored rows, forward + recomputing backward


@pytest.mark.parametrize("case", ["all_negative", "plus_minus_1e4"])
def test_extreme_logits_stay_finite_and_exact(case):
    generator = torch.Generator().manual_seed(3)
    n, h, v = 24, 8, 300
    if case == "all_negative":
        hidden = torch.rand(n, h, generator=generator) + 1.0
        weight = -(torch.rand(v, h, generator=generator) * 50 + 10)  # logits in [-1200, -80]
    else:
        hidden = torch.randn(n, h, generator=generator).sign() * 100.0
        weight = torch.randn(v, h, generator=generator).sign() * 100.0 / h  # logits of exactly +-1e4 and in between
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=generator)
    grads = torch.randn(n, generator=generator), torch.randn(n, generator=generator)
    got = run_op(hidden, weight, labels, grads, temperature=0.7, tile_rows=5)
    want = reference_log_probs_entropy(hidden, weight, labels, temperature=0.7, grad_outputs=grads)
    for tensor in got:
        assert torch.isfinite(tensor).all()
    # fp32 logits of magnitude |z| carry ~|z| * 6e-8 of rounding themselves: tolerance 2e-6 * max |z|.
    largest_logit = (hidden.double() @ weight.double().t()).abs().max().item() / 0.7
    tolerance = 2e-6 * largest_logit
    assert compare.max_abs(got[0], want[0]) <= tolerance, (compare.max_abs(got[0], want[0]), tolerance)
    assert compare.max_abs(got[1], want[1]) <= tolerance, (compare.max_abs(got[1], want[1]), tolerance)
    assert compare.error(want[2], got[2], relative=True) <= 1e-4
    assert compare.error(want[3], got[3], relative=True) <= 1e-4


def test_entropy_optional_and_no_grad_path_identical():
    hidden, weight, labels, _ = make_inputs()
    lp_only, none = log_probs_and_entropy(
        hidden, weight, labels, calculate_entropy=False, backend="torch", tile_rows=16
    )
    assert none is None
    with torch.no_grad():
        lp_nograd, ent_nograd = log_probs_and_entropy(hidden, weight, labels, backend="torch", tile_rows=16)
    lp_grad, ent_grad = log_probs_and_entropy(hidden, weight, labels, backend="torch", tile_rows=16)
    assert not lp_nograd.requires_grad and lp_grad.requires_grad
    assert torch.equal(lp_nograd, lp_grad) and torch.equal(ent_nograd, ent_grad) and torch.equal(lp_only, lp_grad)


def test_batched_shapes_follow_labels():
    hidden, weight, labels, grads = make_inputs(n=24)
    lp, ent = log_probs_and_entropy(hidden.view(4, 6, -1), weight, labels.view(4, 6), backend="torch")
    flat_lp, flat_ent = log_probs_and_entropy(hidden, weight, labels, backend="torch")
    assert lp.shape == (4, 6) and torch.equal(lp.reshape(-1), flat_lp) and torch.equal(ent.reshape(-1), flat_ent)


def test_bitwise_deterministic():
    runs = []
    for _ in range(2):
        hidden, weight, labels, grads = make_inputs()
        runs.append(run_op(hidden, weight, labels, grads, temperature=0.7, tile_rows=16))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_memory_does_not_grow_with_tokens():
    """Peak live bytes (all tensors the op allocates, forward+backward) at N=2k vs N=16k, V=32k."""
    vocab, h, tile_rows = 32768, 64, 256
    tile_bytes = tile_rows * vocab * 4
    weight = torch.randn(vocab, h, requires_grad=True)
    measured = {}
    for n in (2048, 16384):
        hidden = torch.randn(n, h, requires_grad=True)
        labels = torch.randint(0, vocab, (n,))
        with PeakMemory() as peak, SavedTensorBytes(hidden, weight, labels) as saved:
            log_probs, entropy = log_probs_and_entropy(hidden, weight, labels, backend="torch", tile_rows=tile_rows)
            (log_probs.sum() + entropy.sum()).backward()
        measured[n] = (peak.peak, peak.largest, saved.bytes)
        weight.grad = None
    (peak_small, largest_small, saved_small), (peak_large, largest_large, saved_large) = measured[2048], measured[16384]
    print(
        f"peak bytes N=2048: {peak_small}, N=16384: {peak_large}; saved {saved_small} / {saved_large}; "
        f"full logits at N=16384 would be {16384 * vocab * 4}"
    )
    assert largest_small <= tile_bytes and largest_large <= tile_bytes  # no [N, V] tensor ever
    # Saved for backward: per-row statistics only (3 fp32 + an int64 row index = 20 bytes a row).
    assert saved_large <= 20 * 16384 and saved_small <= 20 * 2048
    # Growth from N=2k to 16k: the returned d_hidden and O(N) per-row vectors, nothing tile-sized.
    growth = peak_large - peak_small
    assert growth <= (16384 - 2048) * (2 * h * 4 + 128), growth
    assert peak_large <= 4 * tile_bytes + 2 * vocab * h * 4 + 16384 * (2 * h * 4 + 128)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"backend": "cuda-magic"}, "backend"),
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": torch.full((53,), -0.5)}, "temperature"),
        ({"temperature": torch.ones(3)}, "temperature"),
        ({"tile_rows": 0}, "tile_rows"),
        ({"vocab_size": 1001}, "vocab_size"),
        ({"score_mask": torch.ones(53)}, "score_mask"),
        ({"tp_group": object()}, "tp_group"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    hidden, weight, labels, _ = make_inputs()
    with pytest.raises(ValueError, match=field):
        log_probs_and_entropy(hidden, weight, labels, **kwargs)


def test_bad_shapes_and_labels_name_the_field():
    hidden, weight, labels, _ = make_inputs()
    with pytest.raises(ValueError, match="labels"):
        log_probs_and_entropy(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="weight"):
        log_probs_and_entropy(hidden, weight[:, :-1], labels)
    bad = labels.clone()
    bad[4] = 1000
    with pytest.raises(ValueError, match=r"labels: ids must lie in \[0, 1000\)"):
        log_probs_and_entropy(hidden, weight, bad)
    bad[4] = -3
    with pytest.raises(ValueError, match="labels"):
        log_probs_and_entropy(hidden, weight, bad)


def test_unavailable_backend_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "verl_fused_hook.ops.backends.torch_backend", None)  # its import now fails
    hidden, weight, labels, _ = make_inputs()
    with pytest.raises(ValueError, match="backend='torch' is unavailable here"):
        log_probs_and_entropy(hidden, weight, labels, backend="torch")
