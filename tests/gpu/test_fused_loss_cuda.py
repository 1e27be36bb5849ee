"""The fused policy loss on a CUDA GPU (skipped elsewhere): bf16 inputs through the tensor-core chunk GEMMs,
against fp64 logits followed by the same verl ppo_loss, and against the unfused op followed by ppo_loss."""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook.ops import log_probs_and_entropy, log_probs_entropy_and_loss
from verl_fused_hook_harness.commands.bench import policy_loss as bench_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _inputs(n, h, v):
    g = torch.Generator(device="cuda").manual_seed(6)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    return hidden, weight, labels


def test_fused_loss_bf16_matches_fp64_and_the_unfused_op():
    n, h, v = 2 * bench_loss.SEQUENCE_TOKENS, 1024, 32000
    hidden, weight, labels = _inputs(n, h, v)
    fused = bench_loss.fused_loss_method()
    accuracy = bench_loss.loss_accuracy(fused, hidden, weight, labels, 0.7)
    print("fused_loss vs fp64:", accuracy)
    assert accuracy["loss_rel_err"] < 1e-4
    assert accuracy["d_hidden_rel_err"] < 1e-2 and accuracy["d_weight_rel_err"] < 1e-2  # bf16 d_logits and outputs

    def unfused(h, w, y, temperature, score_mask=None):
        return log_probs_and_entropy(h, w, y, temperature=temperature, backend="torch")

    baseline = bench_loss.loss_accuracy(bench_loss.verl_loss_method(unfused), hidden, weight, labels, 0.7)
    print("unfused torch op + ppo_loss vs fp64:", baseline)
    for key in ("d_hidden_rel_err", "d_weight_rel_err"):
        assert accuracy[key] <= 1.5 * baseline[key] + 1e-4, key  # no worse than the unfused op


def test_host_evaluation_gives_the_device_evaluation_on_cuda():
    """host_loss_fn (hook mode's final evaluation, from pinned copies taken ahead of the last chunk's GEMMs)
    against loss_fn evaluated on the GPU: the same gradients bit for bit (the evaluation never feeds them),
    the loss on the GPU, loss and metrics equal within fp32 rounding of CPU against GPU arithmetic."""
    n, h, v = 4 * bench_loss.SEQUENCE_TOKENS, 512, 32000
    hidden, weight, labels = _inputs(n, h, v)
    loss_fn, row_gradients, host_loss_fn, name, _ = bench_loss.row_loss(n, "cuda")
    results = []
    for host in (None, host_loss_fn):
        x, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        result = log_probs_entropy_and_loss(
            x,
            w,
            labels,
            loss_fn=loss_fn,
            loss_name=name,
            temperature=0.7,
            row_gradients=row_gradients,
            host_loss_fn=host,
            chunk_rows=3000,  # three chunks: the copy is taken at the last
        )
        results.append((result, torch.autograd.grad(result.loss, (x, w))))
    (device, device_grads), (host, host_grads) = results
    assert host.loss.device == device.loss.device and host.loss.dtype == device.loss.dtype
    torch.testing.assert_close(host.loss, device.loss, rtol=1e-6, atol=0)
    for got, want in zip(host_grads, device_grads):
        assert torch.equal(got, want)
    assert host.metrics.keys() == device.metrics.keys()
    for key, metric in device.metrics.items():
        want = metric.aggregate() if hasattr(metric, "aggregate") else metric
        got = host.metrics[key].aggregate() if hasattr(host.metrics[key], "aggregate") else host.metrics[key]
        assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-8), key


def test_chunk_bytes_splits_the_rows_on_cuda():
    """chunk_bytes below the rows' stored logits plus the fp32 d_weight accumulator: several chunks of the
    Triton path, the same loss and gradients as one chunk within bf16 rounding (d_weight adds in fp32)."""
    n, h, v = 4 * bench_loss.SEQUENCE_TOKENS, 512, 32000  # stored logits 0.5 GiB, accumulator 62.5 MiB
    hidden, weight, labels = _inputs(n, h, v)
    loss_fn, row_gradients, host_loss_fn, name, _ = bench_loss.row_loss(n, "cuda")
    calls, runs = [], []

    def counting_row_gradients(rows, lp, ent):
        calls.append(rows.numel())
        return row_gradients(rows, lp, ent)

    for chunk_bytes in (None, 100 * 1024**2):
        calls.clear()
        x, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        result = log_probs_entropy_and_loss(
            x,
            w,
            labels,
            loss_fn=loss_fn,
            loss_name=name,
            temperature=0.7,
            row_gradients=counting_row_gradients,
            host_loss_fn=host_loss_fn,
            chunk_bytes=chunk_bytes,
        )
        runs.append((len(calls), result.loss, torch.autograd.grad(result.loss, (x, w))))
    (one, loss_one, grads_one), (several, loss_several, grads_several) = runs
    assert one == 1 and several >= 5, (one, several)
    torch.testing.assert_close(loss_several, loss_one, rtol=1e-6, atol=0)
    for got, want in zip(grads_several, grads_one):
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
