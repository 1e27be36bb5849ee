"""The fp64 reference itself (verl_fused_hook_harness/support/reference.py), which every accuracy check trusts: row
chunks (what lets the bench's 16384-row check fit an 80 GB card) give what one whole pass gives, and the values and
the log-prob gradient match the closed forms (log p = z_y - logsumexp z, H = logsumexp z - sum p z,
d_hidden = (onehot - p) W / T)."""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook_harness.support.compare import max_abs
from verl_fused_hook_harness.support.reference import loss_reference, reference_log_probs_entropy, relative_error

WHOLE = 1 << 40  # chunk_elements no case reaches: one pass


def _case(rows=(3, 13), hidden=24, vocab=1001, padded=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*rows, hidden, generator=g)
    w = torch.randn(vocab + padded, hidden, generator=g) * 0.3
    labels = torch.randint(0, vocab, rows, generator=g)
    return h, w, labels, g


@pytest.mark.parametrize("chunk_rows", [1, 5, 38])
def test_row_chunks_match_one_pass(chunk_rows):
    """Rows in chunks of 1, 5 and 38 (39 rows, 1001 columns of 1008 weight rows, a temperature a row, a masked
    row): values within 1e-12, both gradients within 1e-12 relative, the padded weight rows' gradient exactly 0."""
    h, w, labels, g = _case()
    temperature = 0.5 + torch.rand(labels.shape, generator=g)
    active = torch.ones_like(labels, dtype=torch.bool)
    active[1, 4] = False
    labels[1, 4] = -100  # an ignored label on the masked row
    grads = (torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g))
    kwargs = {"temperature": temperature, "vocab_size": 1001, "active": active, "grad_outputs": grads}
    whole = reference_log_probs_entropy(h, w, labels, chunk_elements=WHOLE, **kwargs)
    chunked = reference_log_probs_entropy(h, w, labels, chunk_elements=1001 * chunk_rows, **kwargs)
    assert max_abs(whole[0], chunked[0]) <= 1e-12 and max_abs(whole[1], chunked[1]) <= 1e-12
    assert whole[0][1, 4] == 0 and whole[1][1, 4] == 0
    assert relative_error(chunked[2], whole[2]) <= 1e-12 and relative_error(chunked[3], whole[3]) <= 1e-12
    assert chunked[3][1001:].abs().max().item() == 0


def test_closed_forms():
    """log p, H and d_hidden of the log-probs' sum against their closed forms at T = 0.7, in chunks of 4 rows: 1e-12."""
    h, w, labels, _ = _case(padded=0)
    t = 0.7
    lp, ent, dh, dw = reference_log_probs_entropy(
        h, w, labels, temperature=t, grad_outputs=(torch.ones(labels.shape), torch.zeros(labels.shape)),
        chunk_elements=1001 * 4,
    )  # fmt: skip
    z = h.double() @ w.double().t() / t
    lse = z.logsumexp(-1)
    p = torch.softmax(z, -1)
    assert max_abs(z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse, lp) <= 1e-12
    assert max_abs(lse - (p * z).sum(-1), ent) <= 1e-12
    residual = torch.nn.functional.one_hot(labels, w.shape[0]).double() - p
    assert relative_error(dh, residual @ w.double() / t) <= 1e-12
    assert relative_error(dw, residual.reshape(-1, w.shape[0]).t() @ h.double().reshape(-1, h.shape[-1]) / t) <= 1e-12


def test_loss_reference_of_top_k_columns():
    """A loss of k = 5 columns' log-probs a row (a forward KL against fixed targets), in chunks of 3 rows, against
    autograd through the whole fp64 logits: loss and both gradients within 1e-12 relative."""
    h, w, _, g = _case(padded=0)
    ids = torch.randint(0, w.shape[0], (*h.shape[:-1], 5), generator=g)
    target = torch.log_softmax(torch.randn(ids.shape, generator=g, dtype=torch.float64), -1)

    def kl(log_probs, _entropy):
        return (target.exp() * (target - log_probs)).sum()

    loss, dh, dw = loss_reference(h, w, ids, kl, temperature=1.3, chunk_elements=1001 * 3)
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    want = kl(torch.log_softmax(hd @ wd.t() / 1.3, -1).gather(-1, ids), None)
    want_dh, want_dw = torch.autograd.grad(want, (hd, wd))
    assert abs(loss.item() - want.item()) <= 1e-12 * abs(want.item())
    assert relative_error(dh, want_dh) <= 1e-12 and relative_error(dw, want_dw) <= 1e-12


def test_no_rows():
    """An empty batch: empty values and a zero weight gradient, not an error."""
    h, w, labels, _ = _case(rows=(0,))
    lp, ent, dh, dw = reference_log_probs_entropy(h, w, labels, grad_outputs=(torch.ones(0), torch.ones(0)))
    assert lp.shape == (0,) and ent.shape == (0,) and dh.shape == h.shape
    assert dw.shape == w.shape and dw.abs().max().item() == 0
