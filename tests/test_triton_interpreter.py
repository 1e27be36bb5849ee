"""The Triton backend's paths on the CPU, through Triton's interpreter (TRITON_INTERPRET=1), against fp64.

Why: the GPU tests (tests/gpu/test_triton_backend.py, test_triton_chunk_kernels.py) need an H200; this runs
the same kernels' arithmetic and the same host code in CI. The two-pass op: the statistics kernel over
compacted (or all) rows (its label logit picked only from tiles holding labels), the recomputing gradient pass over
vocabulary chunks and row tiles, d_weight
written directly or summed in fp32 per chunk, d_hidden only or d_weight only, no gradients. The fused loss:
the forward kernel keeping fp16 tile-shifted logits, the in-place gradient pass, the chunking and the
d_weight accumulation, with and without the entropy; the two-pass op keeping every row's logits or some
(keep_logits_bytes), on one rank and over two gloo ranks with a padded vocabulary. Named fakes, for what the CPU
cannot do:
- fp16 inputs instead of bf16 (the interpreter's bf16 dot products are not supported);
- a small tile configuration and four "SMs" (`triton_backend.FORWARD_CONFIG`, `triton_backend.GRAD_CONFIG`,
  `triton_backend.num_sms`);
- `torch.addmm(..., out_dtype=torch.float32)` (cuBLAS only) done as an fp32 addmm on fp32 copies;
- the backend's availability check (CUDA, Hopper, bf16) answered "available";
- the interpreter's `tl.dot` (numpy's matmul, so the host BLAS's kernel choice) done as a sum of the K products in
  order (`_row_independent_dot`): an output's bits then depend on its own row and column alone, as on the GPU,
  whatever BLAS kernel, core type or thread count the host picks; the bitwise batch-invariance checks test the
  kernels' split layout and merges, not OpenBLAS.
The interpreter is set at import time, so the checks run in a fresh subprocess.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_fused_hook.ops import backward_plan

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

VALUE_TOL = 1e-5  # fp32 statistics, as the Triton backend's
GRAD_TOL = 1e-3  # fp16 d_logits (2^-11 rounding) and fp16 outputs: relative, Frobenius (3e-4 measured)


def _row_independent_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's `create_dot` without BLAS: a @ b + d with the K products added one after another in d's dtype
    (fp32), each an elementwise numpy operation, so no output depends on which other rows share the tile."""
    import numpy as np
    from triton.runtime.interpreter import TensorHandle, _convert_float, tl

    a_data, b_data = a.data, b.data
    if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or (
        b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()
    ):
        a_data = _convert_float(a_data, a.dtype, tl.float16, None).view(np.float16)
        b_data = _convert_float(b_data, b.dtype, tl.float16, None).view(np.float16)
    dtype = d.data.dtype
    a_data, b_data = a_data.astype(dtype), b_data.astype(dtype)
    total = a_data[..., :, 0:1] * b_data[..., 0:1, :]
    for k in range(1, a_data.shape[-1]):
        total += a_data[..., :, k : k + 1] * b_data[..., k : k + 1, :]
    return TensorHandle(total + d.data, d.dtype.scalar)


def _interpret_on_cpu():
    """The named fakes above; returns the Triton backend module (its backward's budgets are in it too)."""
    import torch
    from triton.runtime.interpreter import InterpreterBuilder

    from verl_fused_hook.ops.backends import triton_backend

    InterpreterBuilder.create_dot = _row_independent_dot

    small = triton_backend.TileConfig(
        block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1, ctas_per_sm=1
    )
    triton_backend.FORWARD_CONFIG = triton_backend.GRAD_CONFIG = small
    triton_backend.num_sms = lambda device: 4
    real_addmm = torch.addmm

    def addmm_fp32_output(accumulator, a, b, *, out_dtype=None, out=None, beta=1, **kwargs):
        if out_dtype is None:
            return real_addmm(accumulator, a, b, out=out, beta=beta, **kwargs)
        return real_addmm(accumulator, a.float(), b.float(), beta=beta, out=out)

    torch.addmm = addmm_fp32_output
    triton_backend.unavailable_reason = lambda p: None  # "auto" then takes the Triton passes on the CPU
    return triton_backend


def _fp64_reference(hidden, weight, labels, active, temperature, g_lp, g_ent):
    """log-probs, entropy and both gradients of sum(g_lp lp + g_ent H) in fp64 autograd (0 on inactive rows)."""
    import torch

    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    log_softmax = torch.log_softmax(hd @ wd.t() / temperature.double().unsqueeze(1), dim=1)
    lp = torch.where(active, log_softmax.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    ent = torch.where(active, -(log_softmax.exp() * log_softmax).sum(1), 0.0)
    ((lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()
    return lp.detach(), ent.detach(), hd.grad, wd.grad


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def _interpreted_two_pass_cases() -> list[dict]:
    """Run in the subprocess: `log_probs_and_entropy(backend="triton")`, each case's errors against fp64."""
    import torch

    from verl_fused_hook.ops import log_probs_and_entropy

    _interpret_on_cpu()
    results = []
    n, h, v = 70, 64, 301
    budgets = {"one tile, one chunk": (8192, 1024**3), "row tiles x vocabulary chunks": (64, 1)}
    cases = [(budget, masked, wants) for budget in budgets for masked in (True, False) for wants in ("both", "weight")]
    cases.append(("row tiles x vocabulary chunks", True, "no entropy"))
    for index, (budget, masked, wants) in enumerate(cases):
        backward_plan.CHUNK_COLUMNS, backward_plan.TILE_MEMORY_BUDGET = budgets[budget]
        backward_plan.SMALL_WALK_TILE_BYTES = 1  # the nominal chunks, not one wide one for these few rows
        g = torch.Generator().manual_seed(100 + index)
        hidden = (torch.randn(n, h, generator=g)).half()
        weight = (torch.randn(v, h, generator=g) * 0.5).half()
        labels = torch.randint(0, v, (n,), generator=g)
        score_mask = torch.rand(n, generator=g) > 0.3 if masked else None
        temperature = torch.rand(n, generator=g) + 0.5
        entropy_on = wants != "no entropy"
        g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g) if entropy_on else torch.zeros(n)
        hid = hidden.clone().requires_grad_(wants != "weight")
        w = weight.clone().requires_grad_()
        lp, ent = log_probs_and_entropy(
            hid,
            w,
            labels,
            temperature=temperature,
            score_mask=score_mask,
            calculate_entropy=entropy_on,
            backend="triton",
        )
        ((lp * g_lp).sum() + ((ent * g_ent).sum() if entropy_on else 0)).backward()
        active = torch.ones(n, dtype=torch.bool) if score_mask is None else score_mask
        ref = _fp64_reference(hidden, weight, labels, active, temperature, g_lp, g_ent)
        with torch.no_grad():
            lp_plain, ent_plain = log_probs_and_entropy(
                hidden,
                weight,
                labels,
                temperature=temperature,
                score_mask=score_mask,
                calculate_entropy=entropy_on,
                backend="triton",
            )
        results.append(
            {
                "case": f"{budget}, {'masked' if masked else 'all rows'}, grads of {wants}",
                "tiles": len(
                    backward_plan.backward_tiling(int(active.sum()), h, v, 16, 32, 4).tiles(int(active.sum()))
                ),
                "log_prob": (lp.double() - ref[0]).abs().max().item(),
                "entropy": (ent.double() - ref[1]).abs().max().item() if entropy_on else 0.0,
                "entropy_is_none": ent is None,
                "d_hidden": None if hid.grad is None else _rel(hid.grad, ref[2]),
                "d_weight": _rel(w.grad, ref[3]),
                "inactive_zero": bool((lp[~active] == 0).all())
                and (hid.grad is None or bool((hid.grad[~active] == 0).all())),
                "no_grad_same": torch.equal(lp_plain, lp.detach())
                and (not entropy_on or torch.equal(ent_plain, ent.detach())),
            }
        )
    return results


def _interpreted_keep_logits_cases() -> list[dict]:
    """Run in the subprocess: the two-pass op with keep_logits_bytes, every scored row kept or some (whole
    16-row blocks, the rest recomputed), one chunk and tile or row tiles x vocabulary chunks, against fp64;
    with how many rows were kept and how many recompute launches the backward made (a counting wrapper)."""
    import torch

    from verl_fused_hook.ops import log_probs_and_entropy
    from verl_fused_hook.ops.arguments import build_problem
    from verl_fused_hook.ops.backends import triton_kernels

    triton_backend = _interpret_on_cpu()
    launches = []

    class CountingLaunches:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launches.append(grid)
            return self.kernel[grid]

    triton_kernels.grad_logits_kernel = CountingLaunches(triton_kernels.grad_logits_kernel)
    n, h, v = 70, 64, 301
    per_row = 2 * 304 + 4 * 10  # fp16 logits at a row pitch of 304, fp32 max of each of the 10 column tiles
    budgets = {"one tile, one chunk": (8192, 1024**3), "row tiles x vocabulary chunks": (64, 1)}
    keeps = {"every row": 10**9, "some rows": 40 * per_row}
    results = []
    for index, (budget, keep, wants) in enumerate(
        [(b, k, "both") for b in budgets for k in keeps] + [("row tiles x vocabulary chunks", "some rows", "weight")]
    ):
        backward_plan.CHUNK_COLUMNS, backward_plan.TILE_MEMORY_BUDGET = budgets[budget]
        backward_plan.SMALL_WALK_TILE_BYTES = 1  # the nominal chunks, not one wide one for these few rows
        g = torch.Generator().manual_seed(200 + index)
        hidden = torch.randn(n, h, generator=g).half()
        weight = (torch.randn(v, h, generator=g) * 0.5).half()
        labels = torch.randint(0, v, (n,), generator=g)
        score_mask = torch.rand(n, generator=g) > 0.2
        temperature = torch.rand(n, generator=g) + 0.5
        g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
        hid = hidden.clone().requires_grad_(wants == "both")
        w = weight.clone().requires_grad_()
        problem = build_problem(
            hid,
            w,
            labels,
            temperature=temperature,
            tp_group=None,
            score_mask=score_mask,
            ignore_index=-100,
            vocab_size=None,
            calculate_entropy=True,
            tile_rows=None,
            keep_logits_bytes=keeps[keep],
        )
        kept = triton_backend.two_pass_passes(problem, True).kept
        launches.clear()
        lp, ent = log_probs_and_entropy(
            hid,
            w,
            labels,
            temperature=temperature,
            score_mask=score_mask,
            backend="triton",
            keep_logits_bytes=keeps[keep],
        )
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        ref = _fp64_reference(hidden, weight, labels, score_mask, temperature, g_lp, g_ent)
        results.append(
            {
                "case": f"{budget}, {keep}, grads of {wants}",
                "scored": int(score_mask.sum()),
                "kept": 0 if kept is None else kept.shifted.shape[0],
                "recompute_launches": len(launches),
                "log_prob": (lp.double() - ref[0]).abs().max().item(),
                "entropy": (ent.double() - ref[1]).abs().max().item(),
                "d_hidden": None if hid.grad is None else _rel(hid.grad, ref[2]),
                "d_weight": _rel(w.grad, ref[3]),
                "inactive_zero": bool((lp[~score_mask] == 0).all())
                and (hid.grad is None or bool((hid.grad[~score_mask] == 0).all())),
            }
        )
    return results


def _interpreted_cases() -> list[dict]:
    """Run in the subprocess: each case's errors against fp64 autograd of the same weighted-sum loss."""
    import torch

    from verl_fused_hook.ops import loss_inside as fused_loss

    _interpret_on_cpu()
    results = []
    n, h, v = 70, 64, 301  # v divides nothing: a partial last tile, a row pitch padded to 8
    for offset, chunk_rows in ((0.0, None), (0.0, 16), (0.0, 48), (-3000.0, 32)):
        g = torch.Generator().manual_seed(len(results))
        if offset:  # exact products and sums near the offset (multiples of 1/128): the kernels' own error only
            hidden = torch.randint(-4, 5, (n, h), generator=g) / 4
            weight = torch.randint(-3, 4, (v, h), generator=g) / 32
            hidden[:, 0], weight[:, 0] = 1.0, offset
        else:
            hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g) * 0.5
        hidden, weight = hidden.half(), weight.half()
        labels = torch.randint(0, v, (n,), generator=g)
        labels[5] = -100
        score_mask = torch.ones(n, dtype=torch.bool)
        score_mask[10:20] = False
        temperature = torch.rand(n, generator=g) + 0.5
        g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

        def loss_fn(log_probs, entropy):
            return (log_probs * g_lp).sum() + (entropy * g_ent).sum(), {}

        hid, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fused_loss.log_probs_entropy_and_loss(
            hid,
            w,
            labels,
            loss_fn=loss_fn,
            loss_name="weighted sum",
            temperature=temperature,
            score_mask=score_mask,
            chunk_rows=chunk_rows,
        )
        out.loss.backward()
        hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
        log_softmax = torch.log_softmax(hd @ wd.t() / temperature.double().unsqueeze(1), dim=1)
        active = score_mask & (labels != -100)
        lp = torch.where(active, log_softmax.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
        ent = torch.where(active, -(log_softmax.exp() * log_softmax).sum(1), 0.0)
        ((lp * g_lp.double()).sum() + (ent * g_ent.double()).sum()).backward()

        def rel(a, b):
            return ((a.double() - b).norm() / b.norm()).item()

        results.append(
            {
                "offset": offset,
                "chunk_rows": chunk_rows,
                "log_prob": (out.log_probs.double() - lp).abs().max().item(),
                "entropy": (out.entropy.double() - ent).abs().max().item(),
                "d_hidden": rel(hid.grad, hd.grad),
                "d_weight": rel(w.grad, wd.grad),
                "inactive_zero": bool((out.log_probs[~active] == 0).all()),
            }
        )
        if not offset and chunk_rows == 16:  # without gradients nothing is kept: one kernel pass, same values
            with torch.no_grad():
                plain = fused_loss.log_probs_entropy_and_loss(
                    hidden,
                    weight,
                    labels,
                    loss_fn=loss_fn,
                    loss_name="weighted sum",
                    temperature=temperature,
                    score_mask=score_mask,
                    chunk_rows=chunk_rows,
                )
            results[-1]["no_grad_log_prob"] = (plain.log_probs.double() - lp.detach()).abs().max().item()
            results[-1]["no_grad_entropy"] = (plain.entropy.double() - ent.detach()).abs().max().item()
    return results


def _interpreted_loss_without_entropy() -> dict:
    """Run in the subprocess: the fused loss with calculate_entropy=False (the gradient pass gets zeros for the
    entropy's gradient), two chunks, against fp64."""
    import torch

    from verl_fused_hook.ops import log_probs_entropy_and_loss

    _interpret_on_cpu()
    g = torch.Generator().manual_seed(7)
    n, h, v = 40, 32, 150
    hidden, weight = torch.randn(n, h, generator=g).half(), (torch.randn(v, h, generator=g) * 0.5).half()
    labels = torch.randint(0, v, (n,), generator=g)
    temperature, g_lp = torch.rand(n, generator=g) + 0.5, torch.randn(n, generator=g)
    hid, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = log_probs_entropy_and_loss(
        hid,
        w,
        labels,
        loss_fn=lambda lp, ent: ((lp * g_lp).sum(), {}),
        loss_name="weighted log-probs",
        temperature=temperature,
        calculate_entropy=False,
        chunk_rows=24,
        backend="triton",
    )
    out.loss.backward()
    ref = _fp64_reference(hidden, weight, labels, torch.ones(n, dtype=torch.bool), temperature, g_lp, torch.zeros(n))
    return {
        "entropy_is_none": out.entropy is None,
        "log_prob": (out.log_probs.double() - ref[0]).abs().max().item(),
        "d_hidden": _rel(hid.grad, ref[2]),
        "d_weight": _rel(w.grad, ref[3]),
    }


def _gspo_like(lengths, old, advantages):
    """A sequence-level loss (GSPO's ratio: exp of the mean log-prob difference over the row's sequence, clipped), in
    the dtype of its inputs; rows are packed sequences of `lengths`."""
    import torch

    seq = torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths))

    def loss_fn(lp, ent):
        count = torch.tensor(lengths, dtype=lp.dtype)
        mean = torch.zeros(len(lengths), dtype=lp.dtype).index_add(0, seq, lp - old.to(lp.dtype)) / count
        ratio = (lp - lp.detach() + mean.detach()[seq]).clamp(max=10).exp()
        adv = advantages.to(lp.dtype)
        pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        return (pg / count[seq]).sum() / len(lengths) - 0.01 * ent.mean(), {}

    return loss_fn


def _interpreted_groups_and_memory() -> dict:
    """Run in the subprocess: the Triton loss-inside passes over chunks of whole row groups (unequal chunks, the kept
    logits' buffer sized by the largest), over chunks sized from an injected free-memory reading (whole row blocks
    of the forward kernel), and the two-pass path when not even one row block fits; each against fp64."""
    import logging

    import torch

    from verl_fused_hook.ops import chunking, log_probs_entropy_and_loss
    from verl_fused_hook.ops.arguments import build_problem

    triton_backend = _interpret_on_cpu()
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("verl_fused_hook.ops.chunking").addHandler(handler)
    lengths = [5, 40, 12, 30, 9, 24]
    n, h, v = sum(lengths), 32, 150
    g = torch.Generator().manual_seed(11)
    hidden, weight = torch.randn(n, h, generator=g).half(), (torch.randn(v, h, generator=g) * 0.5).half()
    labels = torch.randint(0, v, (n,), generator=g)
    groups = torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths))
    with torch.no_grad():  # old log-probs near the current ones: ratios near 1, some clipped
        lp64 = torch.log_softmax(hidden.double() @ weight.double().t() / 0.8, dim=1).gather(1, labels.unsqueeze(1))
    old = (lp64.squeeze(1) + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).float()
    advantages = torch.randn(len(lengths), generator=g)[groups]
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    losses = {
        "gspo-like": _gspo_like(lengths, old, advantages),
        "weighted sum": lambda lp, ent: ((lp * g_lp.to(lp.dtype)).sum() + (ent * g_ent.to(lp.dtype)).sum(), {}),
    }
    references = {}
    for name, loss_fn in losses.items():
        hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
        log_softmax = torch.log_softmax(hd @ wd.t() / 0.8, dim=1)
        ref_loss, _ = loss_fn(
            log_softmax.gather(1, labels.unsqueeze(1)).squeeze(1), -(log_softmax.exp() * log_softmax).sum(1)
        )
        ref_loss.backward()
        references[name] = (ref_loss.item(), hd.grad, wd.grad)
    p = build_problem(
        hidden,
        weight,
        labels,
        temperature=0.8,
        tp_group=None,
        score_mask=None,
        ignore_index=-100,
        vocab_size=None,
        calculate_entropy=True,
        tile_rows=None,
    )
    cost = triton_backend.loss_inside_cost(p, True)
    fixed = chunking.ROW_VECTOR_BYTES * n + chunking.FREE_MEMORY_MARGIN_BYTES + 2 * (n * h + v * h)
    accumulator = 4 * v * h
    results = {}
    for case, loss_name, available, row_groups in (
        ("groups", "gspo-like", None, groups),
        ("free memory", "weighted sum", fixed + accumulator + 47 * cost.row_bytes, None),
        ("no row block fits", "gspo-like", fixed + accumulator + 15 * cost.row_bytes, groups),
    ):
        chunking.available_bytes = lambda device, enough=None, available=available: available
        loss_fn, (ref_loss, ref_dh, ref_dw) = losses[loss_name], references[loss_name]
        calls = []

        def recording(lp, ent):
            calls.append(int(lp.ne(0).sum()))
            return loss_fn(lp, ent)

        hid, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        records.clear()
        out = log_probs_entropy_and_loss(
            hid,
            w,
            labels,
            loss_fn=recording,
            loss_name=loss_name,
            temperature=0.8,
            chunk_rows=48 if row_groups is not None else None,
            row_groups=row_groups,
        )
        out.loss.backward()
        results[case] = {
            "chunk_ends": calls[:-1] if out.loss.grad_fn.name().endswith("FusedLogProbEntropyLossBackward") else None,
            "loss": abs(out.loss.item() - ref_loss) / abs(ref_loss),
            "d_hidden": _rel(hid.grad, ref_dh),
            "d_weight": _rel(w.grad, ref_dw),
            "log": list(records),
        }
    return results


def _interpreted_row_group_cases() -> list[dict]:
    """Run in the subprocess: the two-pass backward over groups of rows (more rows than vocabulary columns, groups
    of 32 rows, each walking the vocabulary in two 32-column chunks and two 16-row tiles; groups taken for any
    saving) against fp64: both gradients (some rows masked), d_hidden only (every row scored: each group's
    d_hidden lands in its span; no d_weight sum), d_weight only (no groups: no d_hidden accumulator to spare);
    with the groups the backward's passes took."""
    import torch

    from verl_fused_hook.ops import log_probs_and_entropy
    from verl_fused_hook.ops.arguments import build_problem

    triton_backend = _interpret_on_cpu()
    backward_plan.CHUNK_COLUMNS, backward_plan.TILE_MEMORY_BUDGET, backward_plan.ROW_GROUP_ROWS = 32, 1, 32
    backward_plan.SMALL_WALK_TILE_BYTES = 1  # the nominal chunks, not one wide one for these few rows
    backward_plan.GROUPS_MIN_SAVING_BYTES = 0  # groups wherever they need less memory at all
    n, h, v = 200, 64, 61
    results = []
    for index, wants in enumerate(("both", "hidden", "weight")):
        g = torch.Generator().manual_seed(400 + index)
        hidden = torch.randn(n, h, generator=g).half()
        weight = (torch.randn(v, h, generator=g) * 0.5).half()
        labels = torch.randint(0, v, (n,), generator=g)
        score_mask = torch.rand(n, generator=g) > 0.1
        if wants == "hidden":  # every row scored: each group's d_hidden lands in its span, no index copy
            score_mask = torch.ones(n, dtype=torch.bool)
        temperature = torch.rand(n, generator=g) + 0.5
        g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
        hid = hidden.clone().requires_grad_(wants != "weight")
        w = weight.clone().requires_grad_(wants != "hidden")
        problem = build_problem(
            hid,
            w,
            labels,
            temperature=temperature,
            tp_group=None,
            score_mask=score_mask,
            ignore_index=-100,
            vocab_size=None,
            calculate_entropy=True,
            tile_rows=None,
        )
        tensors, rebuild = triton_backend.two_pass_passes(problem, True).for_backward()
        groups = [(b.span.start, b.span.stop) for b in rebuild(*tensors).blocks()]
        lp, ent = log_probs_and_entropy(
            hid, w, labels, temperature=temperature, score_mask=score_mask, backend="triton"
        )
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        ref = _fp64_reference(hidden, weight, labels, score_mask, temperature, g_lp, g_ent)
        results.append(
            {
                "case": wants,
                "scored": int(score_mask.sum()),
                "groups": groups,
                "log_prob": (lp.double() - ref[0]).abs().max().item(),
                "entropy": (ent.double() - ref[1]).abs().max().item(),
                "d_hidden": None if hid.grad is None else _rel(hid.grad, ref[2]),
                "d_hidden_inactive_zero": hid.grad is None or bool((hid.grad[~score_mask] == 0).all()),
                "d_weight": None if w.grad is None else _rel(w.grad, ref[3]),
            }
        )
    return results


def _interpreted_label_tile_cases() -> list[dict]:
    """Run in the subprocess: the forward kernel picks each label logit only from tiles that hold some row's label
    (16-row blocks, 32-column tiles, 10 tiles over 301 columns): every label in one tile (the blocks skip nine),
    a block whose labels are only tiles' first columns, one with only last columns (300 in the padded last tile),
    and that one again with its rows masked; log-probs and entropy against fp64."""
    import torch

    from verl_fused_hook.ops import log_probs_and_entropy

    _interpret_on_cpu()
    n, h, v = 48, 64, 301
    first = torch.arange(0, v, 32)  # a block whose labels are only tiles' first columns, one with only last ones
    last = torch.minimum(first + 31, torch.tensor(v - 1))
    edges = torch.cat([first, first[:6], last, last[:6], last[:8], first[:8]])
    placements = {
        "one tile": torch.randint(96, 128, (n,), generator=torch.Generator().manual_seed(7)),
        "tile edges": edges,
        "edges, middle block masked": edges,
    }
    results = []
    for index, (name, labels) in enumerate(placements.items()):
        g = torch.Generator().manual_seed(500 + index)
        hidden = torch.randn(n, h, generator=g).half()
        weight = (torch.randn(v, h, generator=g) * 0.5).half()
        active = torch.ones(n, dtype=torch.bool)
        if name.endswith("masked"):
            active[16:32] = False
            labels = labels.clone()
            labels[20] = -100
        temperature = torch.rand(n, generator=g) + 0.5
        with torch.no_grad():
            lp, ent = log_probs_and_entropy(
                hidden, weight, labels, temperature=temperature, score_mask=active, backend="triton"
            )
        ref = _fp64_reference(
            hidden, weight, labels, active & (labels != -100), temperature, torch.zeros(n), torch.zeros(n)
        )
        results.append(
            {
                "case": name,
                "log_prob": (lp.double() - ref[0]).abs().max().item(),
                "entropy": (ent.double() - ref[1]).abs().max().item(),
            }
        )
    return results


def _interpreted_batch_invariance() -> dict:
    """Run in the subprocess: rows alone, then last in batches of other rows (some masked, with kept logits or
    not, the rows in several launches or one), through the Triton backend's host code and kernels, with
    batch_invariant off (the default) and on; whether every value has the same bits, and the split layouts the
    calls took (the fastest for their row counts: they differ)."""
    import torch

    from verl_fused_hook.ops import log_probs_and_entropy
    from verl_fused_hook.ops.backends import forward_layout

    backend = _interpret_on_cpu()
    g = torch.Generator().manual_seed(21)
    n, h, v, probe = 340, 64, 301, 5
    hidden = torch.randn(n, h, generator=g).half()
    weight = (torch.randn(v, h, generator=g) * 0.3).half()
    labels = torch.randint(0, v, (n,), generator=g)
    temperature = torch.rand(n, generator=g) + 0.5
    c = backend.FORWARD_CONFIG
    col_tiles = -(-v // c.block_n)
    layouts = set()

    def values(rows: torch.Tensor, **options):
        layouts.add(backend.split_layout(-(-rows.numel() // c.block_m), col_tiles, None))
        lp, ent = log_probs_and_entropy(
            hidden[rows], weight, labels[rows], temperature=temperature[rows], backend="triton", **options
        )
        return lp[-probe:].detach(), ent[-probe:].detach()

    same = True
    for invariant in (False, True):
        alone = values(torch.arange(probe), batch_invariant=invariant)
        for count in (3, 40, 300):
            rows = torch.cat([torch.arange(probe, probe + count), torch.arange(probe)])
            mask = torch.arange(rows.numel()) % 2 == 0
            mask[-probe:] = True
            for options in ({}, {"score_mask": mask}):
                lp, ent = values(rows, batch_invariant=invariant, **options)
                same &= torch.equal(lp, alone[0]) and torch.equal(ent, alone[1])
            kept_hidden = hidden[rows].clone().requires_grad_(True)  # kept logits for the first rows only
            lp, ent = log_probs_and_entropy(
                kept_hidden,
                weight,
                labels[rows],
                temperature=temperature[rows],
                backend="triton",
                keep_logits_bytes=16 * (v * 2 + 64),
                batch_invariant=invariant,
            )
            same &= torch.equal(lp[-probe:].detach(), alone[0]) and torch.equal(ent[-probe:].detach(), alone[1])
    # the rows in launches of two row blocks each (their partials over a budget): the same bits again
    forward_layout.TILE_PARTIALS_BUDGET_BYTES = 16 * col_tiles * 2 * c.block_m
    launch_rows = forward_layout.tile_partial_rows(col_tiles, 4, c.block_m)
    rows = torch.cat([torch.arange(probe, n), torch.arange(probe)])
    with torch.no_grad():
        lp, ent = values(rows)
    same &= torch.equal(lp, alone[0]) and torch.equal(ent, alone[1])
    return {"same_bits": bool(same), "layouts": sorted(layouts), "launches": -(-rows.numel() // launch_rows)}


def _run_interpreted(function: str, module: str = Path(__file__).stem):
    """`function()` of the test module `module` (this one by default) in a fresh interpreter-mode subprocess; its
    JSON result."""
    tests = Path(__file__).resolve().parent
    code = (
        f"import json, sys; sys.path.insert(0, {str(tests)!r}); import {module} as t; print(json.dumps(t.{function}()))"
    )
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(tests.parent), os.environ.get("PYTHONPATH", "")]),
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _interpreted_merge_cases() -> list[dict]:
    """Run in the subprocess: `merge_tiles` (merge_tiles_kernel) against softmax_math.merge_partials (the torch
    merge the TP combine still uses) and fp64, square sums against fp64, a row's bits alone against the same row
    among many, and the output written into a slice of a wider buffer (a row group's place)."""
    import torch

    from verl_fused_hook.ops.backends.triton_backend import merge_tiles
    from verl_fused_hook.ops.softmax_math import Partials, merge_partials

    results = []
    for tiles, rows in ((1, 1), (3, 130), (33, 300), (66, 129), (594, 40)):
        g = torch.Generator().manual_seed(tiles * 1000 + rows)
        parts = torch.empty(5, tiles, rows)
        parts[0] = torch.randn(tiles, rows, generator=g) * 30  # tile maxima far apart: rescales down to 0
        parts[1] = torch.rand(tiles, rows, generator=g) * 100 + 1
        parts[2] = -torch.rand(tiles, rows, generator=g) * 50
        parts[3] = 0.0  # the label logit: in one tile of the row's shard, exact zeros elsewhere
        parts[3, torch.randint(0, tiles, (rows,), generator=g), torch.arange(rows)] = torch.randn(rows, generator=g)
        parts[4] = torch.rand(tiles, rows, generator=g) * parts[1]
        wide = torch.full((5, rows + 7), float("nan"))
        merged = Partials(*merge_tiles(parts, wide[:, 3 : 3 + rows])[:4])
        squares = wide[4, 3 : 3 + rows]
        torch_merged = merge_partials(Partials(*parts[:4].unbind(0)))
        d = parts.double()
        row_max = d[0].amax(0)
        rescale = (d[0] - row_max).exp()
        total = (d[1] * rescale).sum(0)
        dot = (rescale * (d[2] + (d[0] - row_max) * d[1])).sum(0)
        square = (d[4] * rescale**2).sum(0)
        alone = merge_tiles(parts[:, :, -1:].contiguous(), torch.empty(5, 1))
        results.append(
            {
                "case": f"{tiles} tiles, {rows} rows",
                "max_equal": bool(torch.equal(merged.row_max, torch_merged.row_max)),
                "sum_vs_fp64": ((merged.sum_exp.double() - total).abs() / total).max().item(),
                "dot_vs_fp64": ((merged.shifted_dot.double() - dot).abs() / dot.abs()).max().item(),
                "square_vs_fp64": ((squares.double() - square).abs() / square).max().item(),
                "label_equal": bool(torch.equal(merged.label_logit, torch_merged.label_logit)),
                "sum_vs_torch": ((merged.sum_exp - torch_merged.sum_exp).abs() / torch_merged.sum_exp).max().item(),
                "last_row_alone_same_bits": bool(torch.equal(alone, wide[:, 2 + rows : 3 + rows])),
                "outside_untouched": bool(wide[:, :3].isnan().all() and wide[:, 3 + rows :].isnan().all()),
            }
        )
    return results


def test_tile_merge_kernel_in_the_interpreter():
    """The forward's per-tile partials merged in one kernel, 32 tiles at a time: the torch merge's values within
    fp32 rounding and its max and label logit exactly (one tile holds the label), fp64 within 1e-6 relative (square
    sums too), a row's bits the same alone as among 300 rows, and the output written only into its slice (a row
    group's columns of the call's buffer)."""
    cases = _run_interpreted("_interpreted_merge_cases")
    assert len(cases) == 5
    for case in cases:
        assert case["max_equal"] and case["label_equal"], case
        assert case["last_row_alone_same_bits"] and case["outside_untouched"], case
        assert case["sum_vs_fp64"] <= 1e-6 and case["dot_vs_fp64"] <= 1e-6 and case["square_vs_fp64"] <= 1e-6, case
        assert case["sum_vs_torch"] <= 1e-6, case


def test_two_pass_triton_path_in_the_interpreter():
    cases = _run_interpreted("_interpreted_two_pass_cases")
    assert len(cases) == 9
    for case in cases:
        label = case["case"]
        assert case["inactive_zero"] and case["no_grad_same"], label
        assert case["log_prob"] <= VALUE_TOL and case["entropy"] <= VALUE_TOL, (label, case)
        assert case["entropy_is_none"] == label.endswith("no entropy"), label
        assert case["d_weight"] <= GRAD_TOL, (label, case)
        if label.endswith("grads of weight"):
            assert case["d_hidden"] is None, label
        else:
            assert case["d_hidden"] <= GRAD_TOL, (label, case)
        assert (case["tiles"] > 1) == label.startswith("row tiles"), (label, case)


def test_two_pass_row_groups_in_the_interpreter():
    cases = {case["case"]: case for case in _run_interpreted("_interpreted_row_group_cases")}
    for label, case in cases.items():
        assert case["log_prob"] <= VALUE_TOL and case["entropy"] <= VALUE_TOL, (label, case)
        assert case["d_hidden_inactive_zero"], label
        assert case["d_hidden"] is None if label == "weight" else case["d_hidden"] <= GRAD_TOL, (label, case)
        assert case["d_weight"] is None if label == "hidden" else case["d_weight"] <= GRAD_TOL, (label, case)
        spans = case["groups"]
        assert spans[0][0] == 0 and spans[-1][1] == case["scored"], (label, spans)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (label, spans)
        if label == "weight":  # no d_hidden accumulator to spare: every row in one walk
            assert len(spans) == 1, spans
        else:  # equal groups of whole 16-row blocks, about 32 rows each
            assert len(spans) == -(-case["scored"] // 32) and all(b - a == 32 for a, b in spans[:-1]), (label, spans)


def test_forward_label_logit_from_the_tiles_holding_labels_in_the_interpreter():
    cases = _run_interpreted("_interpreted_label_tile_cases")
    assert [case["case"] for case in cases] == ["one tile", "tile edges", "edges, middle block masked"]
    for case in cases:
        assert case["log_prob"] <= VALUE_TOL and case["entropy"] <= VALUE_TOL, case


def test_two_pass_keep_logits_in_the_interpreter():
    cases = _run_interpreted("_interpreted_keep_logits_cases")
    assert len(cases) == 5
    for case in cases:
        label = case["case"]
        assert case["inactive_zero"], label
        assert case["log_prob"] <= VALUE_TOL and case["entropy"] <= VALUE_TOL, (label, case)
        assert case["d_weight"] <= GRAD_TOL, (label, case)
        assert case["d_hidden"] is None if label.endswith("grads of weight") else case["d_hidden"] <= GRAD_TOL, (
            label,
            case,
        )
        if ", every row," in label:  # nothing recomputed: d_logits from the kept logits, then two GEMMs
            assert case["kept"] == case["scored"] and case["recompute_launches"] == 0, (label, case)
        else:  # 40 rows' worth of budget keeps two whole 16-row blocks; the rest is recomputed
            assert case["kept"] == 32 < case["scored"] and case["recompute_launches"] > 0, (label, case)


def _tp_keep_logits_worker(rank, world_size, hidden, weight, labels, temperature, g_lp, g_ent, vocab_size, keep_bytes):
    """One rank of two (gloo, Triton's interpreter set by the launcher's environment before Triton's import): its
    vocabulary shard, kept logits within keep_bytes, row tiles x vocabulary chunks; what it kept and returned."""
    import torch.distributed as dist

    from verl_fused_hook.ops import log_probs_and_entropy
    from verl_fused_hook.ops.arguments import build_problem

    triton_backend = _interpret_on_cpu()
    backward_plan.CHUNK_COLUMNS, backward_plan.TILE_MEMORY_BUDGET = 64, 1
    backward_plan.SMALL_WALK_TILE_BYTES = 1  # the nominal chunks, not one wide one for these few rows
    shard = weight.shape[0] // world_size
    h = hidden.clone().requires_grad_()
    w = weight[rank * shard : (rank + 1) * shard].clone().requires_grad_()
    problem = build_problem(
        h,
        w,
        labels,
        temperature=temperature,
        tp_group=dist.group.WORLD,
        score_mask=None,
        ignore_index=-100,
        vocab_size=vocab_size,
        calculate_entropy=True,
        tile_rows=None,
        tp_hidden="partial",
        keep_logits_bytes=keep_bytes,
    )
    kept = triton_backend.two_pass_passes(problem, True).kept
    lp, ent = log_probs_and_entropy(
        h,
        w,
        labels,
        temperature=temperature,
        tp_group=dist.group.WORLD,
        tp_hidden="partial",
        vocab_size=vocab_size,
        backend="triton",
        keep_logits_bytes=keep_bytes,
    )
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return 0 if kept is None else kept.shifted.shape[0], lp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("keep", ["every row", "some rows"])
def test_two_pass_keep_logits_tensor_parallel_in_the_interpreter(keep):
    """Two gloo ranks, a vocabulary padded on rank 1 (160 and 141 real columns: rows of kept logits differ in size,
    so "some rows" keeps 32 rows on rank 0 and 48 on rank 1), against fp64 over the real columns."""
    import torch

    from verl_fused_hook_harness.support.distributed import run_in_processes

    n, h, v, vocab_size = 70, 64, 320, 301
    g = torch.Generator().manual_seed(300)
    hidden = torch.randn(n, h, generator=g).half()
    weight = (torch.randn(v, h, generator=g) * 0.5).half()
    labels = torch.randint(0, vocab_size, (n,), generator=g)
    temperature = torch.rand(n, generator=g) + 0.5
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    keep_bytes = 10**9 if keep == "every row" else 47 * (2 * 160 + 4 * 5)
    results = run_in_processes(
        _tp_keep_logits_worker,
        2,
        hidden,
        weight,
        labels,
        temperature,
        g_lp,
        g_ent,
        vocab_size,
        keep_bytes,
        env={"TRITON_INTERPRET": "1"},
    )
    assert [r[0] for r in results] == ([n, n] if keep == "every row" else [32, 48])
    ref = _fp64_reference(
        hidden, weight[:vocab_size], labels, torch.ones(n, dtype=torch.bool), temperature, g_lp, g_ent
    )
    for _, lp, ent, *_ in results:
        assert (lp.double() - ref[0]).abs().max().item() <= VALUE_TOL
        assert (ent.double() - ref[1]).abs().max().item() <= VALUE_TOL
    d_hidden = sum(r[3].double() for r in results)  # the caller's all-reduce of the partial d_hidden
    d_weight = torch.cat([r[4] for r in results])
    assert _rel(d_hidden, ref[2]) <= GRAD_TOL
    assert _rel(d_weight[:vocab_size], ref[3]) <= GRAD_TOL
    assert bool((d_weight[vocab_size:] == 0).all())


def test_fused_loss_without_entropy_in_the_interpreter():
    case = _run_interpreted("_interpreted_loss_without_entropy")
    assert case["entropy_is_none"]
    assert case["log_prob"] <= VALUE_TOL and case["d_hidden"] <= GRAD_TOL and case["d_weight"] <= GRAD_TOL, case


def test_fused_loss_triton_path_in_the_interpreter():
    cases = _run_interpreted("_interpreted_cases")
    assert len(cases) == 4
    for case in cases:
        label = f"offset {case['offset']}, chunk_rows {case['chunk_rows']}"
        assert case["inactive_zero"], label
        if case["offset"]:
            # fp32 statistics of logits near -3000: the forward kernel's (unchanged) precision there
            assert case["log_prob"] <= 1e-3 and case["entropy"] <= 1e-3, (label, case)
            # d_hidden along the offset's unit: 3000 x (sum of d_logits, exactly 0), so fp16 d_logits
            # rounding is amplified there (the same for exact d_logits rounded to fp16); d_weight is not
            assert case["d_weight"] <= GRAD_TOL, (label, case)
        else:
            assert case["log_prob"] <= VALUE_TOL and case["entropy"] <= VALUE_TOL, (label, case)
            assert case["d_hidden"] <= GRAD_TOL and case["d_weight"] <= GRAD_TOL, (label, case)
    no_grad = [case for case in cases if "no_grad_log_prob" in case]
    assert len(no_grad) == 1
    assert no_grad[0]["no_grad_log_prob"] <= VALUE_TOL and no_grad[0]["no_grad_entropy"] <= VALUE_TOL, no_grad


def test_gradient_pass_refuses_an_output_dtype_that_cannot_overwrite_the_stored_logits():
    import torch

    from verl_fused_hook.ops.backends.triton_backend import StoredLogits, stored_grad_logits

    store = StoredLogits(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(2, 1), 8)
    rows = torch.zeros(2)
    with pytest.raises(ValueError, match=r"out_dtype: must be a 2-byte float .*torch\.float32"):
        stored_grad_logits(store, torch.zeros(2, dtype=torch.long), *[rows] * 6, torch.float32)


def test_fused_loss_chunks_of_row_groups_and_free_memory_in_the_interpreter():
    cases = _run_interpreted("_interpreted_groups_and_memory")
    # whole groups packed up to 48 rows: (5, 40) (12, 30) (9, 24)
    assert cases["groups"]["chunk_ends"] == [45, 87, 120], cases["groups"]
    # 47 rows fit beside the accumulator: whole 16-row blocks of the forward kernel, 32, as four equal chunks of 30
    assert cases["free memory"]["chunk_ends"] == [30, 60, 90, 120], cases["free memory"]
    # fewer than one 16-row block fits: the two-pass path (Triton's recomputing passes), said in the log
    assert cases["no row block fits"]["chunk_ends"] is None
    assert len(cases["no row block fits"]["log"]) == 1
    assert "too little free GPU memory for a chunk of 16 rows" in cases["no row block fits"]["log"][0]
    assert "this call runs the two-pass path" in cases["no row block fits"]["log"][0]
    for name, case in cases.items():
        assert case["loss"] <= 1e-4, (name, case)  # fp32 statistics of fp16 inputs against fp64
        assert case["d_hidden"] <= GRAD_TOL and case["d_weight"] <= GRAD_TOL, (name, case)
