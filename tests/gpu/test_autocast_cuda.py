"""Under CUDA autocast the op computes exactly as without it (skipped without a CUDA device).

Autocast would turn the op's GEMMs into bf16/fp16 ones; the op turns it off
in its forward and its backward, so the results under autocast must equal
those without (same kernels on the same inputs) and stay within fp32's
accuracy of the fp64 reference for fp32 inputs.
"""

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


def _run(backend, dtype, autocast_dtype):
    g = torch.Generator(device="cuda").manual_seed(9)
    n, h, v = 513, 256, 8192
    hidden = torch.randn(n, h, device="cuda", generator=g).to(dtype).requires_grad_(True)
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).to(dtype).requires_grad_(True)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    with torch.autocast("cuda", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        lp, ent = log_probs_and_entropy(hidden, weight, labels, temperature=0.8, backend=backend)
        (lp * g_lp + ent * g_ent).sum().backward()
    return (hidden, weight, labels, (g_lp, g_ent)), (lp.detach(), ent.detach(), hidden.grad, weight.grad)


@pytest.mark.parametrize(
    "backend, dtype, autocast_dtype",
    [
        ("torch", torch.float32, torch.bfloat16),
        ("torch", torch.bfloat16, torch.float16),
        ("triton", torch.bfloat16, torch.float16),
    ],
)
def test_autocast_changes_nothing(backend, dtype, autocast_dtype):
    if backend == "triton":
        pytest.importorskip("triton")
    _, plain = _run(backend, dtype, None)
    inputs, under_autocast = _run(backend, dtype, autocast_dtype)
    # torch: the same cuBLAS calls, so equal; triton: allows run-to-run variation of its backward far
    # below the ~1e-3 an fp16 GEMM would cause
    tolerance = 1e-6 if backend == "torch" else 1e-4
    for name, got, want in zip(("log_probs", "entropy", "d_hidden", "d_weight"), under_autocast, plain):
        assert got.dtype == want.dtype and compare.error(want, got, relative=True) <= tolerance, name
    if dtype == torch.float32:
        hidden, weight, labels, grads = inputs
        ref = reference_log_probs_entropy(hidden, weight, labels, temperature=0.8, grad_outputs=grads)
        assert compare.max_abs(under_autocast[0], ref[0]) <= 5e-5 and compare.max_abs(under_autocast[1], ref[1]) <= 5e-5
        assert compare.error(ref[2], under_autocast[2], relative=True) <= 1e-5
        assert compare.error(ref[3], under_autocast[3], relative=True) <= 1e-5
