"""The portable torch backend on a CUDA GPU (skipped elsewhere): fp32 inputs take the exact fp32 path,
bf16 inputs the tensor-core path (fp32 accumulation and outputs, bf16 d_logits in the backward)."""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook.ops import log_probs_and_entropy
from verl_fused_hook_harness.support import compare
from verl_fused_hook_harness.support.reference import reference_log_probs_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype, value_tol, grad_tol", [(torch.float32, 5e-5, 1e-5), (torch.bfloat16, 5e-5, 4e-3)])
def test_torch_backend_on_cuda_matches_fp64(dtype, value_tol, grad_tol):
    g = torch.Generator(device="cuda").manual_seed(4)
    n, h, v, vocab = 777, 320, 32008, 32003
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).to(dtype).requires_grad_(True)
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    temperature = torch.rand(n, device="cuda", generator=g) + 0.5
    score_mask = torch.rand(n, device="cuda", generator=g) > 0.3
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    lp, ent = log_probs_and_entropy(
        hidden,
        weight,
        labels,
        temperature=temperature,
        vocab_size=vocab,
        score_mask=score_mask,
        backend="torch",
        tile_rows=100,
    )
    (lp * g_lp + ent * g_ent).sum().backward()
    ref_lp, ref_ent, ref_dh, ref_dw = reference_log_probs_entropy(
        hidden, weight, labels, temperature=temperature, vocab_size=vocab, active=score_mask, grad_outputs=(g_lp, g_ent)
    )
    assert compare.max_abs(lp, ref_lp) <= value_tol and compare.max_abs(ent, ref_ent) <= value_tol
    assert _rel(hidden.grad, ref_dh) <= grad_tol
    assert _rel(weight.grad, ref_dw) <= grad_tol
    assert hidden.grad.dtype == dtype and torch.count_nonzero(weight.grad[vocab:]) == 0
