"""The Triton backend's `return_label_is_max` output against an fp64 argmax on a CUDA GPU (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook.ops import log_probs_and_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# fp32 accumulation of H=512 bf16 products differs from fp64 by ~1e-5 at these magnitudes;
# rows whose fp64 top-two gap is below this are left out of the comparison (and counted).
MIN_GAP = 1e-3


@pytest.mark.parametrize("n, v", [(4096, 50257), (37, 151936)])  # many rows (one split), few rows (vocab splits)
def test_triton_label_is_max_matches_fp64_argmax(n, v):
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(n, 512, device="cuda", generator=g).bfloat16().requires_grad_(True)
    weight = (torch.randn(v, 512, device="cuda", generator=g) * 512**-0.5).bfloat16()
    logits = (hidden.double() @ weight.double().t()) / 0.8
    top2 = logits.topk(2, dim=1)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[::2] = top2.indices[::2, 0]
    score_mask = torch.arange(n, device="cuda") % 7 != 3
    log_probs, _, label_is_max = log_probs_and_entropy(
        hidden, weight, labels, temperature=0.8, score_mask=score_mask, backend="triton", return_label_is_max=True
    )
    clear = (top2.values[:, 0] - top2.values[:, 1]) > MIN_GAP
    want = (labels == top2.indices[:, 0]) & score_mask
    assert label_is_max.dtype == torch.bool and not label_is_max.requires_grad
    assert int(clear.sum()) >= 0.95 * n, f"only {int(clear.sum())} of {n} rows clear of near ties"
    assert torch.equal(label_is_max[clear], want[clear])
    assert not bool(label_is_max[~score_mask].any())
    log_probs.sum().backward()  # the extra output leaves the backward as it was
    assert torch.isfinite(hidden.grad.float()).all()
