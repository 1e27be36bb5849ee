"""`replayed_log_probs` on the CPU against fp64 (tests/replay_reference.py): given kept sets (padded and vLLM's CSR)
and sets computed in the trainer with vLLM's rule; per-row temperatures, a vocabulary that divides nothing, ignored
and masked rows, given ids, both compute paths (the union GEMM, and the batch-invariant fixed-order sums), extreme
logits, empty selections, the errors. Tolerances: fp32 values 1e-5 absolute, gradients 1e-5 relative (Frobenius);
bf16 inputs 2e-3 / 1e-2 (the inputs' own rounding is shared by the reference; fp32 products of bf16 are exact).
"""

from __future__ import annotations

import logging

import pytest
import torch
from replay_reference import replayed_reference
from saved_tensors import SavedTensorBytes

from verl_fused_hook import replayed_log_probs
from verl_fused_hook_harness.support.truncated_sampling import vllm_keep_mask

H, V, VOCAB = 40, 251, 247  # a vocabulary that divides nothing, padding columns past 247
VALUE_TOL, GRAD_TOL = 1e-5, 1e-5


def _max_abs(a, b):
    return (a.double() - b).abs().max().item() if a.numel() else 0.0


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def _case(n=60, seed=0, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(V, H, generator=g) * 0.4 * scale).to(dtype)
    hidden = torch.randn(n, H, generator=g).to(dtype)
    labels = torch.randint(0, VOCAB, (n,), generator=g)
    labels[3] = -100  # ignored
    temperature = torch.rand(n, generator=g) + 0.5
    score_mask = torch.rand(n, generator=g) > 0.2
    return hidden, weight, labels, temperature, score_mask


def _random_sets(labels, width, seed):
    """[N, width] ids with -1 padding at random places, each row's label among them, sizes 1..width."""
    g = torch.Generator().manual_seed(seed)
    rows = labels.numel()
    kept = torch.full((rows, width), -1)
    for r in range(rows):
        size = int(torch.randint(1, width + 1, (1,), generator=g))
        ids = torch.randperm(VOCAB, generator=g)[:size]
        label = int(labels[r])
        if label >= 0 and label not in ids.tolist():
            ids[0] = label
        slots = torch.randperm(width, generator=g)[:size]
        kept[r, slots] = ids
    return kept


def _keep_mask(kept):
    spill = torch.where(kept >= 0, kept, V)  # padding into a column past the vocabulary, dropped
    return torch.zeros(kept.shape[0], V + 1, dtype=torch.bool).scatter(1, spill, True)[:, :V]


def _check_against_reference(out, hidden, weight, labels, temperature, active, keep, tolerances, token_ids=None):
    value_tol, grad_tol = tolerances
    g = torch.Generator().manual_seed(9)
    g_lp, g_ent = torch.randn(labels.numel(), generator=g), torch.randn(labels.numel(), generator=g)
    g_tok = None if token_ids is None else torch.randn(token_ids.shape, generator=g)
    loss = (out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum()
    if token_ids is not None:
        loss = loss + torch.where(torch.isfinite(out.token_log_probs), out.token_log_probs * g_tok, 0.0).sum()
    loss.backward()
    ref = replayed_reference(hidden, weight, labels, keep, temperature, active, g_lp, g_ent, token_ids, g_tok)
    assert _max_abs(out.log_probs.detach(), ref[0]) <= value_tol
    assert _max_abs(out.entropy.detach(), ref[1]) <= value_tol
    if token_ids is not None:
        finite = torch.isfinite(ref[2]) & active.unsqueeze(1)
        assert torch.equal(torch.isfinite(out.token_log_probs) | ~active.unsqueeze(1), finite | ~active.unsqueeze(1))
        assert _max_abs(out.token_log_probs.detach()[finite], ref[2][finite]) <= value_tol
    return ref


@pytest.mark.parametrize("batch_invariant", [False, True])
@pytest.mark.parametrize("layout", ["padded", "csr"])
def test_given_sets_match_fp64_values_and_gradients(batch_invariant, layout):
    hidden, weight, labels, temperature, score_mask = _case()
    kept = _random_sets(labels, 9, seed=1)
    g = torch.Generator().manual_seed(2)
    token_ids = torch.randint(0, VOCAB, (labels.numel(), 4), generator=g)
    token_ids[:, 0] = kept[:, kept.argmax(1)[0]].clamp_min(0)  # some asked ids inside the sets, most outside
    token_ids[:, 1] = kept.max(dim=1).values.clamp_min(0)
    hid, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    sets = {"kept_ids": kept}
    if layout == "csr":  # vLLM's SamplingMask: ids row after row, offsets
        valid = kept >= 0
        sets = {"kept_csr": (kept[valid], torch.cat([torch.zeros(1, dtype=torch.long), valid.sum(1).cumsum(0)]))}
    out = replayed_log_probs(
        hid, w, labels, temperature=temperature, score_mask=score_mask, vocab_size=VOCAB, token_ids=token_ids,
        batch_invariant=batch_invariant, chunk_rows=16, **sets,
    )  # fmt: skip
    active = score_mask & (labels >= 0)
    ref = _check_against_reference(
        out, hidden, weight, labels, temperature, active, _keep_mask(kept), (VALUE_TOL, GRAD_TOL), token_ids
    )
    assert _rel(hid.grad, ref[3]) <= GRAD_TOL and _rel(w.grad, ref[4]) <= GRAD_TOL
    assert bool((hid.grad[~active] == 0).all()) and bool((w.grad[VOCAB:] == 0).all())
    outside = ~_keep_mask(kept)[active].any(dim=0)  # columns in no scored row's set get no gradient at all
    assert bool((w.grad[outside] == 0).all())
    # the returned sets: each scored row's ids, left-aligned, -1 padding; rows not computed -1
    for r in range(labels.numel()):
        expected = sorted(kept[r][kept[r] >= 0].tolist()) if active[r] else []
        assert sorted(out.kept_ids[r][out.kept_ids[r] >= 0].tolist()) == expected
    assert out.kept_mass is None and out.label_added is None


def test_bf16_inputs_and_extreme_logits():
    """bf16 hidden/weight (fp32 products, as the reference's) and logits of +-1e3 scale (no overflow)."""
    for dtype, scale, tolerances in ((torch.bfloat16, 1.0, (2e-3, 1e-2)), (torch.float32, 300.0, (1e-3, 1e-5))):
        hidden, weight, labels, temperature, score_mask = _case(seed=3, scale=scale, dtype=dtype)
        kept = _random_sets(labels, 6, seed=4)
        for invariant in (False, True):
            hid, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            out = replayed_log_probs(
                hid, w, labels, temperature=temperature, score_mask=score_mask, vocab_size=VOCAB, kept_ids=kept,
                batch_invariant=invariant,
            )  # fmt: skip
            assert out.log_probs.dtype == torch.float32
            active = score_mask & (labels >= 0)
            ref = _check_against_reference(
                out, hidden.float(), weight.float(), labels, temperature, active, _keep_mask(kept), tolerances
            )
            assert bool(torch.isfinite(out.log_probs).all()) and bool(torch.isfinite(hid.grad.float()).all())
            assert _rel(hid.grad, ref[3]) <= tolerances[1] and _rel(w.grad, ref[4]) <= tolerances[1]


@pytest.mark.parametrize(
    "top_k, top_p",
    [(50, 0.9), (20, 1.0), (-1, 0.8), (-1, 0.999)],  # 0.999 without top-k: sets past the first 64 candidates
)
def test_trainer_side_sets_follow_vllms_rule(top_k, top_p):
    hidden, weight, labels, temperature, score_mask = _case(n=50, seed=5)
    logits = hidden.double() @ weight.double().t()
    logits[:, VOCAB:] = float("-inf")
    keep = vllm_keep_mask(logits, temperature, top_k, top_p)
    active = score_mask & (labels >= 0)
    labels = torch.where(active, _a_kept_label(keep, seed=6), labels)  # the "rollout" sampled inside its set
    hid, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = replayed_log_probs(
        hid, w, labels, temperature=temperature, score_mask=score_mask, vocab_size=VOCAB, top_k=top_k, top_p=top_p,
        backend="torch",
    )  # fmt: skip
    for r in torch.nonzero(active).squeeze(1).tolist():
        assert set(out.kept_ids[r][out.kept_ids[r] >= 0].tolist()) == set(torch.nonzero(keep[r]).squeeze(1).tolist())
    assert not bool(out.label_added.any())
    full = torch.softmax(logits / temperature.double().unsqueeze(1), dim=1)
    mass = torch.where(keep, full, 0.0).sum(1)
    assert _max_abs(out.kept_mass[active], mass[active]) <= 1e-5
    ref = _check_against_reference(out, hidden, weight, labels, temperature, active, keep, (VALUE_TOL, GRAD_TOL))
    assert _rel(hid.grad, ref[3]) <= GRAD_TOL and _rel(w.grad, ref[4]) <= GRAD_TOL
    if top_k > 0:
        assert int((out.kept_ids >= 0).sum(1).max()) <= top_k


def _a_kept_label(keep, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(keep.double(), 1, generator=g).squeeze(1)


def test_top_k_keeps_ties_at_the_kth_logit():
    """Four equal logits straddle the 3rd place: vLLM keeps all of them (5 ids for top_k=3)."""
    hidden = torch.ones(2, 4)
    weight = torch.zeros(12, 4)
    weight[0] = 2.0  # logit 8
    weight[[5, 6, 7, 9]] = 1.0  # logit 4, four times
    labels = torch.tensor([9, 0])
    out = replayed_log_probs(hidden, weight, labels, top_k=3, backend="torch")
    assert sorted(out.kept_ids[0][out.kept_ids[0] >= 0].tolist()) == [0, 5, 6, 7, 9]
    expected = 4 - torch.logsumexp(torch.tensor([8.0, 4, 4, 4, 4], dtype=torch.float64), 0)
    assert abs(out.log_probs[0].item() - expected.item()) <= VALUE_TOL
    assert out.kept_ids[0, 0].item() == 0  # highest logit first, then the ties by lower id


def test_a_label_outside_the_computed_set_is_added_and_marked(caplog):
    """Trainer-side: the label at the boundary (here far outside) joins its set, finite log-prob, one log line."""
    hidden, weight, labels, temperature, _ = _case(n=12, seed=7)
    logits = hidden.double() @ weight.double().t()
    labels = logits[:, :VOCAB].argmin(1)  # the least likely token: outside any top-k = 5 set
    labels[1] = logits[1, :VOCAB].argmax()
    with caplog.at_level(logging.DEBUG, logger="verl_fused_hook.ops.replay"):  # a warning the first time only
        out = replayed_log_probs(hidden, weight, labels, top_k=5, vocab_size=VOCAB, backend="torch")
    added = torch.ones(12, dtype=torch.bool)
    added[1] = False
    assert torch.equal(out.label_added, added)
    assert bool(torch.isfinite(out.log_probs).all())
    keep = vllm_keep_mask(logits, torch.ones(12), 5, 1.0)
    keep[torch.arange(12), labels] = True
    ref = replayed_reference(hidden, weight, labels, keep, torch.ones(12), torch.ones(12, dtype=torch.bool),
                             torch.zeros(12), torch.zeros(12))  # fmt: skip
    assert _max_abs(out.log_probs, ref[0]) <= VALUE_TOL
    assert "added to its set and marked in label_added" in caplog.text


def test_rows_keep_their_bits_whatever_the_batch_with_the_flag():
    """batch_invariant=True: a row's values and d_hidden the same bits alone and among other rows, in other chunks
    (given sets and computed ones)."""
    hidden, weight, labels, temperature, _ = _case(n=80, seed=8)
    kept = _random_sets(labels.clamp_min(0), 12, seed=9)
    labels = labels.clamp_min(0)

    def run(rows, chunk_rows, **sets):
        hid = hidden[rows].clone().requires_grad_()
        out = replayed_log_probs(
            hid, weight, labels[rows], temperature=temperature[rows], vocab_size=VOCAB, batch_invariant=True,
            chunk_rows=chunk_rows, **{k: v[rows] if k == "kept_ids" else v for k, v in sets.items()},
        )  # fmt: skip
        (out.log_probs.sum() + 0.3 * out.entropy.sum()).backward()
        return out.log_probs[-5:].detach(), out.entropy[-5:].detach(), hid.grad[-5:]

    for sets in ({"kept_ids": kept}, {"top_k": 7, "top_p": 0.9, "backend": "torch"}):
        alone = run(torch.arange(5), None, **sets)
        for count, chunk_rows in ((1, None), (40, 8), (75, 16)):
            rows = torch.cat([torch.arange(5, 5 + count), torch.arange(5)])
            inside = run(rows, chunk_rows, **sets)
            assert all(torch.equal(a, b) for a, b in zip(alone, inside)), (sets, count)


def test_no_rows_scored_and_no_vocabulary_sized_tensor_saved():
    hidden, weight, labels, temperature, _ = _case(n=30, seed=10)
    kept = _random_sets(labels.clamp_min(0), 5, seed=11)
    hid, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    nothing = torch.zeros(30, dtype=torch.bool)
    out = replayed_log_probs(hid, w, labels, kept_ids=kept, score_mask=nothing, vocab_size=VOCAB)
    assert out.kept_ids.shape == (30, 0) and bool((out.log_probs == 0).all())
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert bool((hid.grad == 0).all()) and bool((w.grad == 0).all())
    with SavedTensorBytes(hid, w) as saved:
        replayed_log_probs(hid, w, labels.clamp_min(0), kept_ids=kept, vocab_size=VOCAB)
    # the [rows, |S|] logits and three numbers per row, far below one row of [rows, vocab]
    assert 0 < saved.bytes <= 30 * 5 * 4 + 3 * 30 * 4 + 30 * 5 * 8 + 1024


def test_bad_arguments_are_refused_by_name():
    hidden, weight, labels, _, _ = _case(n=6, seed=12)
    labels = labels.clamp_min(0)
    kept = torch.stack([labels, torch.full_like(labels, -1)], 1)
    cases = [
        ({}, "nothing to replay"),
        ({"kept_ids": kept, "top_p": 0.9}, "top_k/top_p: the kept sets were given"),
        ({"kept_ids": kept, "kept_csr": (labels, torch.arange(7))}, "pass the kept sets one way"),
        ({"top_k": 0}, r"top_k: expected -1 \(off\) or an int >= 1, got 0"),
        ({"top_p": 1.5}, r"top_p: expected a number in \(0, 1\]"),
        ({"top_k": 600}, "top_k: 600 exceeds max_kept=512"),
        ({"kept_ids": kept.float()}, "kept_ids: expected an integer torch.Tensor"),
        ({"kept_ids": kept[:, :1] + 1}, "kept_ids: scored row 0's label .* is not in its kept set"),
        ({"kept_ids": torch.stack([labels, labels], 1)}, "kept_ids: a kept set holds each id once"),
        ({"kept_ids": kept, "max_kept": 0}, "max_kept: must be an int >= 1"),
        ({"kept_ids": torch.stack([labels, torch.full_like(labels, 999)], 1)}, r"ids must lie in \[0, 251\)"),
        ({"kept_csr": (labels, torch.arange(6))}, "kept_csr.offsets: must hold rows \\+ 1 = 7"),
        ({"kept_csr": (labels, torch.tensor([0, 2, 1, 3, 4, 5, 6]))}, "must start at 0, never decrease"),
        ({"top_p": 0.999999, "max_kept": 3}, "max_kept: scored row 0's kept set .* holds more than max_kept=3"),
        ({"kept_ids": kept, "backend": "verl"}, "backend: 'verl' cannot run replayed_log_probs; allowed: auto, "),
        (
            {"kept_ids": kept, "backend": "triton"},
            "backend: 'triton' cannot run replayed_log_probs here: (CUDA is not available|hidden is on cpu)",
        ),
        ({"kept_ids": kept[None]}, r"kept_ids: must be shaped like labels \(6,\) plus a last dim"),
        ({"kept_csr": labels}, r"kept_csr: expected a pair \(token_ids, offsets\)"),
        ({"kept_csr": (labels.float(), torch.arange(7))}, "kept_csr.token_ids: expected a 1-d integer"),
        ({"kept_ids": kept, "token_ids": kept.float()}, r"token_ids: expected an integer torch.Tensor \[..., k\]"),
        ({"kept_ids": kept, "token_ids": labels}, r"token_ids: must be shaped like labels \(6,\) plus a last dim"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            replayed_log_probs(hidden, weight, labels, **({"backend": "torch"} | arguments))


def test_d_weight_into_main_grad_as_megatron_layers_do():
    """gradient_accumulation_fusion: d_weight added onto an fp32 main_grad (straight) or a bf16 one (summed in fp32,
    rounded once); the placeholder returned where DDP tracks grad_added_to_main_grad."""
    hidden, weight, labels, temperature, _ = _case(n=40, seed=13)
    labels = labels.clamp_min(0)
    kept = _random_sets(labels, 7, seed=14)
    w = weight.clone().requires_grad_()
    out = replayed_log_probs(hidden, w, labels, temperature=temperature, kept_ids=kept, vocab_size=VOCAB)
    (out.log_probs.sum() - out.entropy.sum()).backward()
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        w_fused = weight.clone().requires_grad_()
        w_fused.main_grad = torch.ones(V, H, dtype=dtype)
        w_fused.grad_added_to_main_grad = False
        out = replayed_log_probs(
            hidden, w_fused, labels, temperature=temperature, kept_ids=kept, vocab_size=VOCAB,
            gradient_accumulation_fusion=True,
        )  # fmt: skip
        (out.log_probs.sum() - out.entropy.sum()).backward()
        assert w_fused.grad_added_to_main_grad is True
        assert _rel(w_fused.main_grad.float() - 1, w.grad) <= tolerance
