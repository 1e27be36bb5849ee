"""backend="verl" on a CUDA GPU (skipped elsewhere): the same bits as calling verl's kernel directly the way the
hook did before verl became a backend: `linear_cross_entropy(hidden_sbh, weight, labels_sb.contiguous(), float,
"none", None)`, outputs and both gradients."""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook.ops import log_probs_and_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_verl_backend_gives_the_bits_of_verls_kernel():
    kernel = pytest.importorskip("verl.utils.kernel.linear_cross_entropy").linear_cross_entropy
    s, b, h, v = 257, 3, 1024, 32000
    g = torch.Generator(device="cuda").manual_seed(3)
    hidden = torch.randn(s, b, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    labels = torch.randint(0, v, (b, s), device="cuda", generator=g)  # [b, s], as megatron hands them
    g_lp, g_ent = torch.randn(s, b, device="cuda", generator=g), torch.randn(s, b, device="cuda", generator=g)

    def run(direct: bool):
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if direct:
            lp, ent = kernel(x, w, labels.t().contiguous(), 0.7, "none", None)
            lp, ent = lp.view(s, b), ent.view(s, b)
        else:
            lp, ent = log_probs_and_entropy(x, w, labels.t(), temperature=0.7, backend="verl")
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return lp, ent, x.grad, w.grad

    direct, again = run(True), run(True)
    assert all(torch.equal(a, b) for a, b in zip(direct, again)), "verl's kernel itself differs run to run"
    for name, ours, theirs in zip(("log_probs", "entropy", "d_hidden", "d_weight"), run(False), direct):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs), name
