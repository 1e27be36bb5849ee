"""The backend registry on the CPU: choices, capability queries, build-time checks, and verl's kernel as a
backend (its refusals, each naming the field, and the exact call it makes, against a named fake kernel)."""

import dataclasses
import logging

import pytest
import torch

from verl_fused_hook.ops import (
    BACKEND_CHOICES,
    BackendCapabilities,
    backend_capabilities,
    backend_unavailable_at_build,
    log_probs_and_entropy,
    log_probs_entropy_and_loss,
)

EVERYTHING = BackendCapabilities(
    per_row_temperature=True, row_selection=True, padded_vocabulary=True, label_is_max=True, loss_inside=True
)


def inputs(s=4, b=3, h=128, v=64, seed=0):
    """Megatron's layout: hidden [s, b, h], labels [s, b] (a transposed view, as the hook passes them)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(s, b, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.1
    labels = torch.randint(0, v, (b, s), generator=g).t()
    return hidden, weight, labels


def test_choices_and_capabilities():
    assert BACKEND_CHOICES == ("auto", "triton", "torch", "verl")
    for name in ("auto", "triton"):
        assert backend_capabilities(name) == dataclasses.replace(EVERYTHING, keep_logits=True), name
    assert backend_capabilities("torch") == dataclasses.replace(EVERYTHING, batch_invariant_on_cuda=False)
    assert backend_capabilities("verl") == BackendCapabilities(
        per_row_temperature=False,
        row_selection=False,
        padded_vocabulary=False,
        label_is_max=False,
        loss_inside=False,
        selected_tokens=False,
    )
    with pytest.raises(ValueError, match=r"backend: unknown 'cuda'; allowed: auto, triton, torch, verl"):
        backend_capabilities("cuda")


@pytest.mark.parametrize("value", [-1, 1.5, True, None])
def test_keep_logits_bytes_must_be_a_non_negative_int(value):
    hidden, weight, labels = inputs()
    with pytest.raises(ValueError, match=r"keep_logits_bytes: must be an int >= 0 \(0: recompute every row\), got"):
        log_probs_and_entropy(hidden, weight, labels, keep_logits_bytes=value)


def test_keep_logits_on_a_backend_that_recomputes_says_so_once_and_changes_nothing(caplog, monkeypatch):
    from verl_fused_hook import log_once
    from verl_fused_hook.ops import two_pass

    monkeypatch.setattr(log_once, "_said", set())  # nothing said yet
    hidden, weight, labels = inputs()
    plain = log_probs_and_entropy(hidden, weight, labels, backend="torch")
    with caplog.at_level(logging.INFO, logger=two_pass.__name__):
        for _ in range(2):
            kept = log_probs_and_entropy(hidden, weight, labels, backend="torch", keep_logits_bytes=1 << 30)
    assert [r.getMessage() for r in caplog.records] == [
        "log_probs_and_entropy: keep_logits_bytes=1073741824 ignored: backend 'torch' recomputes every row's logits "
        "(only 'triton' keeps them)"
    ]
    assert all(torch.equal(a, b) for a, b in zip(plain, kept))


def test_build_time_checks_need_no_tensors():
    assert backend_unavailable_at_build("auto", hidden_size=100, device_type="cpu") is None
    assert backend_unavailable_at_build("torch", hidden_size=100, device_type="cpu") is None
    assert (
        backend_unavailable_at_build("triton", hidden_size=4096, device_type="cpu") == "needs CUDA; the model is on cpu"
    )
    assert backend_unavailable_at_build("verl", hidden_size=100, device_type="cuda") == (
        "hidden: verl's kernel needs H % 128 == 0, got H=100"
    )
    assert backend_unavailable_at_build("verl", hidden_size=128, device_type="cpu") == (
        "hidden: verl's kernel needs CUDA tensors, got cpu"
    )
    with pytest.raises(ValueError, match="backend: unknown"):
        backend_unavailable_at_build("nope", hidden_size=128, device_type="cpu")


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(temperature="per_row"),
            r"temperature: verl's kernel takes one float for every row, got a per-row tensor",
        ),
        (
            dict(score_mask="half"),
            r"score_mask/ignore_index: verl's kernel scores every row, but 6 of 12 rows are left out",
        ),
        (
            dict(ignore_row=True),
            r"score_mask/ignore_index: verl's kernel scores every row, but 1 of 12 rows are left out",
        ),
        (
            dict(vocab_size=60),
            r"vocab_size: verl's kernel takes no padded vocabulary, got vocab_size=60 below V_local \* tp size = 64",
        ),
        (dict(return_label_is_max=True), r"return_label_is_max: verl's kernel has no label-is-max output"),
        (dict(h=96), r"hidden: verl's kernel needs H % 128 == 0, got H=96"),
        ({}, r"hidden: verl's kernel needs CUDA tensors, got cpu"),  # everything else it takes: refused on the CPU
    ],
)
def test_verl_backend_refuses_what_its_kernel_cannot_take(change, message):
    hidden, weight, labels = inputs(h=change.get("h", 128))
    kwargs = {}
    if change.get("temperature") == "per_row":
        kwargs["temperature"] = torch.full(labels.shape, 0.7)
    if change.get("score_mask") == "half":
        kwargs["score_mask"] = torch.arange(labels.numel()).view(labels.shape) % 2 == 0
    if change.get("ignore_row"):
        labels = labels.clone()
        labels[0, 0] = -100
    if "vocab_size" in change:
        labels = labels % change["vocab_size"]
    for key in ("vocab_size", "return_label_is_max"):
        if key in change:
            kwargs[key] = change[key]
    with pytest.raises(ValueError, match=r"backend='verl' is unavailable here: " + message):
        log_probs_and_entropy(hidden, weight, labels, backend="verl", **kwargs)


def test_loss_inside_refuses_a_whole_problem_backend():
    hidden, weight, labels = inputs()
    with pytest.raises(
        ValueError, match=r"backend='verl' cannot run log_probs_entropy_and_loss: .* allowed: auto, triton, torch"
    ):
        log_probs_entropy_and_loss(
            hidden, weight, labels, loss_fn=lambda lp, ent: (lp.sum(), {}), loss_name="x", backend="verl"
        )


@pytest.fixture
def fake_verl_kernel(monkeypatch):
    """A named fake of verl's `linear_cross_entropy` (CUDA only), recording its arguments: the portable op with
    verl's contract (fp32 outputs [N], the shard's partial d_hidden); the backend's CUDA check is lifted."""
    import verl.utils.kernel.linear_cross_entropy as verl_kernel

    from verl_fused_hook.ops.backends import verl_backend

    calls = []

    def fake_linear_cross_entropy(hidden, weight, labels, temperature, reduction, tp_group):
        calls.append(
            dict(
                hidden=hidden,
                weight=weight,
                labels=labels,
                temperature=temperature,
                reduction=reduction,
                tp_group=tp_group,
            )
        )
        return log_probs_and_entropy(
            hidden, weight, labels, temperature=temperature, tp_group=tp_group, tp_hidden="partial", backend="torch"
        )

    monkeypatch.setattr(verl_kernel, "linear_cross_entropy", fake_linear_cross_entropy)
    monkeypatch.setattr(verl_backend, "unavailable_reason", lambda problem: None)
    return calls


@pytest.mark.parametrize("calculate_entropy", [True, False])
def test_verl_backend_calls_the_kernel_as_verl_does(fake_verl_kernel, calculate_entropy):
    hidden, weight, labels = inputs()
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    log_probs, entropy = log_probs_and_entropy(
        h, w, labels, temperature=0.7, backend="verl", calculate_entropy=calculate_entropy
    )
    (call,) = fake_verl_kernel
    # hidden [s, b, h] flattened to [N, H] as the kernel does itself (the same memory), labels contiguous
    assert call["hidden"].shape == (12, 128) and call["hidden"].data_ptr() == h.data_ptr()
    assert call["labels"].is_contiguous() and torch.equal(call["labels"], labels.reshape(-1))
    assert call["weight"] is w
    assert type(call["temperature"]) is float and call["temperature"] == 0.7
    assert call["reduction"] == "none" and call["tp_group"] is None
    assert log_probs.shape == labels.shape and (entropy is None) == (not calculate_entropy)
    log_probs.sum().backward()
    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want, _ = log_probs_and_entropy(h_ref, w_ref, labels, temperature=0.7, backend="torch")
    want.sum().backward()
    assert torch.equal(log_probs, want) and torch.equal(h.grad, h_ref.grad) and torch.equal(w.grad, w_ref.grad)


def test_auto_never_picks_verl(fake_verl_kernel):
    hidden, weight, labels = inputs()
    log_probs_and_entropy(hidden, weight, labels)
    assert fake_verl_kernel == []


def test_describe_backends_names_the_pick_and_every_other_reason():
    from verl_fused_hook.ops import describe_backends

    reasons = describe_backends(torch.zeros(3, 96), torch.zeros(5, 96))
    assert reasons == {
        "triton": reasons["triton"], "torch": None, "verl": "hidden: verl's kernel needs H % 128 == 0, got H=96",
        "auto": "torch",
    }  # fmt: skip
    assert reasons["triton"] in ("CUDA is not available", "hidden is on cpu")
