"""`log_probs_entropy_and_loss` on its own (CPU, portable passes): what it refuses and why, against the two-pass op.

verl's ppo_loss inside the op is tests/test_fused_loss.py's; here the losses are small ones written out, so
each refusal has one cause: a loss whose gradient is NaN/inf, a loss that is not token-separable.
"""

import pytest
import torch

from verl_fused_hook.ops import (
    NonFiniteLossGradientError,
    NonSeparableLossError,
    log_probs_and_entropy,
    log_probs_entropy_and_loss,
)

RTOL = 1e-5


def inputs(n=30, h=8, v=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * 0.5).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, labels


def test_weighted_sum_matches_the_two_pass_op():
    hidden, weight, labels = inputs()
    g_lp, g_ent = torch.randn(30), torch.randn(30)
    fused = log_probs_entropy_and_loss(
        hidden,
        weight,
        labels,
        temperature=0.7,
        chunk_rows=7,
        backend="torch",
        loss_name="weighted sum",
        loss_fn=lambda lp, ent: ((lp * g_lp).sum() + (ent * g_ent).sum(), {}),
    )
    d_fused = torch.autograd.grad(fused.loss, (hidden, weight))
    lp, ent = log_probs_and_entropy(hidden, weight, labels, temperature=0.7, backend="torch", tile_rows=7)
    d_two_pass = torch.autograd.grad((lp * g_lp).sum() + (ent * g_ent).sum(), (hidden, weight))
    for got, want in zip(d_fused, d_two_pass):
        assert float((got - want).abs().max()) <= RTOL * float(want.abs().max())


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_an_upstream_gradient_scales_both_gradients_in_fp32_rounded_once(dtype):
    """megatron's schedule back-propagates a scaled loss (by the CP size, an fp16 loss scale, 1/micro-batches): the
    backward multiplies the stored gradients by that factor in fp32 and rounds once, bit for bit what scaling an
    fp32 copy gives (the backward now scales in place, without the copy); a factor of 1 leaves them as they are."""
    hidden, weight, labels = (t.detach().to(dtype) if t.is_floating_point() else t for t in inputs())

    def gradients(factor):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        fused = log_probs_entropy_and_loss(
            h, w, labels, temperature=0.7, chunk_rows=7, backend="torch", loss_name="mean",
            loss_fn=lambda lp, ent: (lp.mean() + 0.1 * ent.mean(), {}),
        )  # fmt: skip
        return torch.autograd.grad(fused.loss * factor if factor is not None else fused.loss, (h, w))

    unscaled = gradients(None)
    factor = torch.tensor(0.3711, dtype=torch.float32)
    for got, base in zip(gradients(factor), unscaled):
        assert got.dtype == dtype and torch.equal(got, (base.float() * factor).to(dtype))
        assert float(got.abs().max()) > 0
    for got, base in zip(gradients(torch.tensor(1.0)), unscaled):
        assert torch.equal(got, base)


def test_the_backward_of_a_scaled_loss_allocates_no_gradient_sized_buffer():
    """The backward scales the stored gradients in place: its allocations (torch's CPU memory profiler, summed in
    time order) peak far below one d_weight (an fp32 copy of d_weight and its product came to 27 MB here)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 256, generator=g).bfloat16().requires_grad_(True)
    weight = (torch.randn(4000, 256, generator=g) * 0.5).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 4000, (64,), generator=g)
    fused = log_probs_entropy_and_loss(
        hidden, weight, labels, backend="torch", loss_name="mean", loss_fn=lambda lp, ent: (lp.mean(), {})
    )
    scaled = fused.loss * torch.tensor(0.37)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        scaled.backward()
    allocated = peak = 0
    for event in sorted((e for e in prof.events() if e.cpu_memory_usage), key=lambda e: e.time_range.start):
        allocated += event.cpu_memory_usage
        peak = max(peak, allocated)
    assert peak < weight.numel() * weight.element_size() // 100, peak
    assert float(weight.grad.abs().max()) > 0 and float(hidden.grad.abs().max()) > 0


def test_a_loss_with_an_infinite_gradient_is_reported_as_that():
    """Row 11's weight is inf: the per-chunk and final gradients are both inf there, and inf - inf is NaN, which
    the separability comparison alone would report as 'not token-separable, differ by up to nan'."""
    hidden, weight, labels = inputs()
    scale = torch.ones(30)
    scale[11] = float("inf")
    with pytest.raises(NonFiniteLossGradientError) as raised:
        log_probs_entropy_and_loss(
            hidden,
            weight,
            labels,
            chunk_rows=7,
            loss_name="scaled",
            calculate_entropy=False,
            loss_fn=lambda lp, ent: ((lp * scale).sum(), {}),
        )
    message = str(raised.value)
    assert message.startswith(
        "loss scaled: its gradient is not finite (NaN/inf) in the log-prob of 1 scored rows (first: row 11, "
        "from autograd of the loss)"
    )
    assert "token-separable" not in message


def test_row_gradients_that_are_nan_are_named():
    hidden, weight, labels = inputs()
    g_lp = torch.ones(30)
    g_lp[[4, 20]] = float("nan")
    with pytest.raises(
        NonFiniteLossGradientError, match=r"in the log-prob of 2 scored rows \(first: row 4, from its row_gradients\)"
    ):
        log_probs_entropy_and_loss(
            hidden,
            weight,
            labels,
            chunk_rows=7,
            loss_name="sum",
            calculate_entropy=False,
            loss_fn=lambda lp, ent: (lp.sum(), {}),
            row_gradients=lambda rows, lp, ent: (g_lp[rows], None),
        )


def test_a_nan_gradient_in_the_entropy_is_named():
    hidden, weight, labels = inputs()
    with pytest.raises(
        NonFiniteLossGradientError, match=r"loss root: its gradient is not finite \(NaN/inf\) in the entropy"
    ):
        log_probs_entropy_and_loss(  # d sqrt(H - 10)/dH is NaN: every entropy here is below 10
            hidden,
            weight,
            labels,
            chunk_rows=7,
            loss_name="root",
            loss_fn=lambda lp, ent: ((ent - 10).sqrt().sum(), {}),
        )


def test_a_loss_that_is_not_token_separable_is_still_refused():
    hidden, weight, labels = inputs()
    with pytest.raises(
        NonSeparableLossError, match=r"loss squared sum: its gradient in the log-prob of a row depends on other rows"
    ):
        log_probs_entropy_and_loss(  # d (sum lp)^2 / d lp_i = 2 sum lp: every row's gradient depends on all rows
            hidden,
            weight,
            labels,
            chunk_rows=7,
            loss_name="squared sum",
            loss_fn=lambda lp, ent: (lp.sum() ** 2, {}),
        )


def test_one_chunk_makes_any_loss_exact():
    hidden, weight, labels = inputs()
    fused = log_probs_entropy_and_loss(
        hidden,
        weight,
        labels,
        loss_name="squared sum",
        loss_fn=lambda lp, ent: (lp.sum() ** 2, {}),
    )
    lp, _ = log_probs_and_entropy(hidden, weight, labels, backend="torch")
    want = torch.autograd.grad(lp.sum() ** 2, (hidden, weight))
    for got, ref in zip(torch.autograd.grad(fused.loss, (hidden, weight)), want):
        assert float((got - ref).abs().max()) <= RTOL * float(ref.abs().max())


def test_no_scored_row_gives_zero_gradients():
    """With every row masked no chunk runs; d_weight used to be left uninitialized."""
    hidden, weight, labels = inputs()
    with torch.no_grad():
        weight.mul_(1e30)  # garbage, if read, would show
    fused = log_probs_entropy_and_loss(
        hidden,
        weight,
        labels,
        score_mask=torch.zeros(30, dtype=torch.bool),
        loss_name="sum",
        loss_fn=lambda lp, ent: (lp.sum(), {}),
    )
    fused.loss.backward()
    assert torch.count_nonzero(hidden.grad) == 0 and torch.count_nonzero(weight.grad) == 0


def test_an_unavailable_backend_is_named():
    hidden, weight, labels = inputs()
    with pytest.raises(ValueError, match=r"backend='triton' is unavailable here: CUDA is not available"):
        log_probs_entropy_and_loss(
            hidden, weight, labels, loss_name="x", loss_fn=lambda lp, ent: (lp.sum(), {}), backend="triton"
        )


def test_bf16_inputs_through_the_portable_passes():
    """The portable passes return an fp32 chunk d_hidden for bf16 inputs; it used to meet index_copy_ into the bf16
    d_hidden and raise. Same result as the two-pass op (both compute in fp32 on the CPU, round once)."""
    hidden, weight, labels = inputs()
    hidden, weight = hidden.detach().bfloat16().requires_grad_(True), weight.detach().bfloat16().requires_grad_(True)
    fused = log_probs_entropy_and_loss(
        hidden,
        weight,
        labels,
        chunk_rows=7,
        backend="torch",
        loss_name="sum",
        loss_fn=lambda lp, ent: (lp.sum(), {}),
    )
    got = torch.autograd.grad(fused.loss, (hidden, weight))
    lp, _ = log_probs_and_entropy(hidden, weight, labels, backend="torch", tile_rows=7)
    want = torch.autograd.grad(lp.sum(), (hidden, weight))
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16
        assert float((g.float() - w.float()).abs().max()) <= 1e-2 * float(w.float().abs().max())
