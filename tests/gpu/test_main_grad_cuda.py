"""gradient_accumulation_fusion on the Triton backend against fp64 (CUDA; skipped elsewhere).

d_weight added into an fp32 `main_grad` (as megatron's DDP gives every parameter) over several groups of rows,
each walking the whole vocabulary (backward_plan.row_groups with the sum in place): log-probs, entropy and
d_hidden as without it, d_weight without its bf16 rounding, and the backward's working memory one group's walk.
The `main_grad` / `grad_added_to_main_grad` attributes set by hand in the first test are the ones megatron's DDP
sets; the last runs the hook on a tiny GPTModel in megatron's real DDP, built on megatron-core's local layer spec
(`build_cpu_gpt`) whether Transformer Engine is installed or not.
"""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook.ops import backward_plan, log_probs_and_entropy
from verl_fused_hook.ops.backends.triton_backend import GRAD_CONFIG
from verl_fused_hook_harness.support import compare
from verl_fused_hook_harness.support.reference import reference_log_probs_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# the gradient kernel's tile, which the backward plan cuts rows and columns into
GRAD_BLOCKS = dict(block_m=GRAD_CONFIG.block_m, block_n=GRAD_CONFIG.block_n)

VALUE_TOL = 5e-5
GRAD_TOL = 2.5e-3  # relative (Frobenius) against fp64, bf16 inputs
N, H, V, TRUE_VOCAB = 60000, 512, 16000, 15990


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(71)
    hidden = torch.randn(N, H, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=g) * H**-0.5 * 2).bfloat16()
    labels = torch.randint(0, TRUE_VOCAB, (N,), device="cuda", generator=g)
    score_mask = torch.rand(N, device="cuda", generator=g) > 0.1
    g_lp, g_ent = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g)
    return hidden, weight, labels, score_mask, g_lp, g_ent


def _step(hidden, weight, labels, score_mask, g_lp, g_ent, fusion):
    h = hidden.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(
        h,
        weight,
        labels,
        temperature=0.8,
        score_mask=score_mask,
        vocab_size=TRUE_VOCAB,
        backend="triton",
        gradient_accumulation_fusion=fusion,
    )
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp, ent, h.grad


def test_groups_of_rows_add_into_fp32_main_grad():

    hidden, weight, labels, score_mask, g_lp, g_ent = _inputs()
    scored = int(score_mask.sum())
    assert len(backward_plan.row_groups(scored, H, TRUE_VOCAB, True, True, True, **GRAD_BLOCKS)) >= 2
    assert len(backward_plan.row_groups(scored, H, TRUE_VOCAB, True, True, **GRAD_BLOCKS)) == 1

    plain = weight.clone().requires_grad_()
    lp0, ent0, d_hidden0 = _step(hidden, plain, labels, score_mask, g_lp, g_ent, False)
    fused = weight.clone().requires_grad_()
    fused.main_grad = torch.full(weight.shape, 0.5, device="cuda")  # an earlier micro-batch's sum
    fused.grad_added_to_main_grad = False
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent, d_hidden = _step(hidden, fused, labels, score_mask, g_lp, g_ent, True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert fused.grad_added_to_main_grad is True

    ref = reference_log_probs_entropy(
        hidden, weight, labels, temperature=0.8, vocab_size=TRUE_VOCAB, active=score_mask, grad_outputs=(g_lp, g_ent)
    )
    assert compare.max_abs(lp, ref[0]) <= VALUE_TOL and compare.max_abs(ent, ref[1]) <= VALUE_TOL
    assert torch.equal(lp, lp0) and torch.equal(ent, ent0)
    errors = {
        "d_hidden": _rel(d_hidden, ref[2]),
        "d_hidden_returned": _rel(d_hidden0, ref[2]),
        "d_weight": _rel(fused.main_grad.double() - 0.5, ref[3]),
        "d_weight_returned": _rel(plain.grad, ref[3]),
    }
    assert errors["d_hidden"] <= GRAD_TOL and errors["d_hidden"] <= 1.01 * errors["d_hidden_returned"], errors
    # no bf16 rounding of d_weight
    assert errors["d_weight"] <= GRAD_TOL and errors["d_weight"] < errors["d_weight_returned"], errors
    assert bool((fused.main_grad[TRUE_VOCAB:] == 0.5).all())
    # beyond the outputs (h's copy, its bf16 d_hidden, the placeholder gradient) and what the forward saves (the
    # scored rows' compacted copy, per-row statistics): one group's walk
    returned = 2 * N * H + 2 * N * H + 2 * V * H
    saved = 2 * scored * H + 32 * 1024**2
    assert peak - returned - saved <= backward_plan.IN_PLACE_WALK_BYTES, (peak - returned - saved) / 1024**2


def test_token_log_probs_adds_into_fp32_main_grad():
    """token_log_probs (distillation's op): d_weight into main_grad in groups of rows, against fp64, and not rounded to
    bf16 as the returned one is; the ids' log-probs and the top-k as without it."""
    from verl_fused_hook.ops import token_log_probs

    hidden, weight, labels, score_mask, g_lp, g_ent = _inputs()
    g = torch.Generator(device="cuda").manual_seed(5)
    ids = torch.randint(0, TRUE_VOCAB, (N, 8), device="cuda", generator=g)
    g_ids = torch.randn(N, 8, device="cuda", generator=g)

    def step(w, fusion):
        out = token_log_probs(
            hidden, w, labels, ids, temperature=0.8, score_mask=score_mask, vocab_size=TRUE_VOCAB, top_k=4,
            backend="triton", gradient_accumulation_fusion=fusion,
        )  # fmt: skip
        ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum() + (out.token_log_probs * g_ids).sum()).backward()
        return out

    plain = weight.clone().requires_grad_()
    want = step(plain, False)
    fused = weight.clone().requires_grad_()
    fused.main_grad = torch.full(weight.shape, 0.5, device="cuda")
    fused.grad_added_to_main_grad = False
    got = step(fused, True)
    assert fused.grad_added_to_main_grad is True
    assert torch.equal(got.token_log_probs, want.token_log_probs) and torch.equal(got.top_ids, want.top_ids)
    w = weight.double().requires_grad_()
    logits = hidden.double() @ w[:TRUE_VOCAB].t() / 0.8
    log_softmax = torch.log_softmax(logits, -1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    loss = (log_softmax.gather(-1, labels[:, None])[:, 0] * g_lp + entropy * g_ent) * score_mask
    loss = loss.sum() + ((log_softmax.gather(-1, ids) * g_ids).sum(-1) * score_mask).sum()
    (d_weight,) = torch.autograd.grad(loss, w)
    errors = {"main_grad": _rel(fused.main_grad.double() - 0.5, d_weight), "returned": _rel(plain.grad, d_weight)}
    assert errors["main_grad"] <= GRAD_TOL and errors["main_grad"] < errors["returned"], errors
    assert bool((fused.main_grad[TRUE_VOCAB:] == 0.5).all())


def test_verl_backend_refuses_it():
    pytest.importorskip("verl")
    hidden, weight, labels, *_ = _inputs()
    w = weight.clone().requires_grad_()
    w.main_grad = torch.zeros(weight.shape, device="cuda")
    with pytest.raises(ValueError, match="backend 'verl'"):
        log_probs_and_entropy(hidden[:64], w, labels[:64], backend="verl", gradient_accumulation_fusion=True)


def _ddp_worker(rank, world_size, tied):
    """A tiny bf16 GPTModel in megatron's real DDP (fp32 main_grad) on the GPU, the hook with the Triton backend,
    two micro-batches without and with the output layer's gradient_accumulation_fusion (set on the built layer:
    megatron's own fused linear needs apex, which the hook never calls). Deterministic steps, so that every
    gradient but the output weight's must come out bitwise equal."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from verl_fused_hook import FusedOutputProcessorContext, fused_output_processor
    from verl_fused_hook_harness.stand_ins.megatron_cpu import (
        build_cpu_gpt,
        init_model_parallel,
        tiny_transformer_config,
    )
    from verl_fused_hook_harness.support.determinism import deterministic_steps, prepare_cublas_workspace

    prepare_cublas_workspace()
    init_model_parallel(1)
    config = tiny_transformer_config(params_dtype=torch.bfloat16)
    model = build_cpu_gpt(config, vocab_size=1024, tied=tied).cuda()
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    weight = ddp.module.shared_embedding_or_output_weight() if tied else ddp.module.output_layer.weight
    g = torch.Generator(device="cuda").manual_seed(3)
    batches = [
        (
            torch.randint(0, 1000, (1, 256), device="cuda", generator=g),
            torch.randint(0, 1000, (1, 256), device="cuda", generator=g),
        )
        for _ in range(2)
    ]
    position_ids = torch.arange(256, device="cuda")[None]
    main_grads, flags = [], []
    with deterministic_steps(ddp):
        for fusion in (False, True):
            ddp.zero_grad_buffer()
            ddp.module.output_layer.gradient_accumulation_fusion = fusion
            for input_ids, labels in batches:
                context = FusedOutputProcessorContext(temperature=0.8, vocab_size=1000, backend="triton")
                out = ddp(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    attention_mask=None,
                    labels=labels,
                    output_processor=fused_output_processor,
                    output_processor_context=context,
                )
                (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
                flags.append(weight.grad_added_to_main_grad)
            ddp.finish_grad_sync()
            main_grads.append({name: p.main_grad.cpu().clone() for name, p in ddp.module.named_parameters()})
    output_name = next(name for name, p in ddp.module.named_parameters() if p is weight)
    return main_grads, flags, output_name


@pytest.mark.parametrize("tied", [False, True])
def test_hook_under_megatron_ddp_on_the_gpu(tied):
    from verl_fused_hook_harness.support.distributed import run_in_processes

    (returned, fused), flags, output_name = run_in_processes(_ddp_worker, 1, tied, backend="nccl")[0]
    assert flags == [False, False, True, True]
    for name, expected in returned.items():
        if name == output_name:  # bf16-rounded d_weight added twice, against fp32 sums: within bf16 rounding
            assert _rel(fused[name], expected) <= 2.0**-8, _rel(fused[name], expected)
            assert _rel(fused[name], expected) > 0
        else:
            assert torch.equal(fused[name], expected), name
