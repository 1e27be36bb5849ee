"""gradient_accumulation_fusion: d_weight added into Megatron's `main_grad` instead of returned (CPU).

Against fp64 at the op (portable backend, several blocks, masked rows, padded vocabulary, T != 1, on top of an
earlier micro-batch's main_grad), over two tensor-parallel gloo ranks, for the loss-inside op, and through the
hook on a real megatron-core GPTModel wrapped in megatron's real DistributedDataParallel (tied and untied output
weight, with and without overlap_grad_reduce): every parameter's main_grad after two micro-batches equals the one
megatron gets from the returned gradient. The `main_grad` / `grad_added_to_main_grad` / `zero_out_wgrad`
attributes set by hand in the op-level tests are the ones megatron's DDP and LanguageModule set.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from verl_fused_hook import FusedOutputProcessorContext, fused_output_processor
from verl_fused_hook.ops import log_probs_and_entropy, log_probs_entropy_and_loss, token_log_probs
from verl_fused_hook_harness.support.distributed import run_in_processes
from verl_fused_hook_harness.support.reference import reference_log_probs_entropy

N, H, V, TRUE_VOCAB, T = 61, 24, 43, 40, 0.7
VALUE_TOL = 5e-5  # log-prob and entropy max error (fp32 level, logits up to ~20 here)
FP32_RTOL = 1e-6  # fp32 gradients against fp64, relative to the largest entry
BF16_ROUNDING = 2.0**-8  # one bf16 rounding of an element, with margin


def _inputs(dtype=torch.float32, seed=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) * H**-0.5 * 4).to(dtype)
    labels = torch.randint(0, TRUE_VOCAB, (N,), generator=g)
    labels[::7] = -100
    score_mask = torch.rand(N, generator=g) > 0.25
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden, weight, labels, score_mask, g_lp, g_ent


def _as_ddp_parameter(weight, main_grad_dtype=torch.float32, *, seed=11, zero_out_wgrad=None):
    """The weight as megatron's DDP leaves a parameter: `main_grad` (here holding an earlier micro-batch's sum)
    and `grad_added_to_main_grad`; `zero_out_wgrad` as LanguageModule sets it on a tied weight."""
    param = torch.nn.Parameter(weight.clone())
    param.main_grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed)).to(main_grad_dtype)
    param.grad_added_to_main_grad = False
    if zero_out_wgrad is not None:
        param.zero_out_wgrad = zero_out_wgrad
    return param


def _run(hidden, weight, labels, score_mask, g_lp, g_ent, fusion, tile_rows=None):
    h = hidden.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(
        h,
        weight,
        labels,
        temperature=T,
        score_mask=score_mask,
        vocab_size=TRUE_VOCAB,
        backend="torch",
        tile_rows=tile_rows,
        gradient_accumulation_fusion=fusion,
    )
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    return lp, ent, h.grad


@pytest.mark.parametrize("tile_rows", [None, 9])  # one block; seven blocks adding into main_grad
def test_main_grad_gets_the_fp64_weight_gradient(tile_rows):
    hidden, weight, labels, score_mask, g_lp, g_ent = _inputs()
    param = _as_ddp_parameter(weight)
    before = param.main_grad.clone()
    lp, ent, d_hidden = _run(hidden, param, labels, score_mask, g_lp, g_ent, True, tile_rows)
    active = score_mask & (labels != -100)
    ref = reference_log_probs_entropy(
        hidden, weight, labels, temperature=T, vocab_size=TRUE_VOCAB, active=active, grad_outputs=(g_lp, g_ent)
    )
    d_weight = ref[3]  # [V, H], zero in the padding columns
    added = param.main_grad.double() - before.double()
    assert (added - d_weight).abs().max().item() <= FP32_RTOL * d_weight.abs().max().item()
    assert bool((param.main_grad[TRUE_VOCAB:] == before[TRUE_VOCAB:]).all())  # padding columns: nothing added
    assert (d_hidden.double() - ref[2]).abs().max().item() <= FP32_RTOL * ref[2].abs().max().item()
    assert (lp.double() - ref[0]).abs().max().item() <= VALUE_TOL
    assert (ent.double() - ref[1]).abs().max().item() <= VALUE_TOL
    # megatron's protocol: the placeholder gradient is marked as already added, so DDP's hook skips it
    assert param.grad_added_to_main_grad is True and param.grad is not None and param.grad.shape == param.shape


def test_returned_gradient_follows_megatron():
    hidden, weight, labels, score_mask, g_lp, g_ent = _inputs()
    tied = _as_ddp_parameter(weight, zero_out_wgrad=True)
    _run(hidden, tied, labels, score_mask, g_lp, g_ent, True)
    assert bool((tied.grad == 0).all())  # zeros: a tied embedding's own gradient is summed with it

    plain = torch.nn.Parameter(weight.clone())  # main_grad without DDP's flag: nothing returned
    plain.main_grad = torch.zeros(V, H)
    _run(hidden, plain, labels, score_mask, g_lp, g_ent, True)
    assert plain.grad is None and plain.main_grad.abs().sum() > 0

    unfused = _as_ddp_parameter(weight)  # without the flag the gradient is returned, main_grad untouched
    before = unfused.main_grad.clone()
    _run(hidden, unfused, labels, score_mask, g_lp, g_ent, False)
    assert torch.equal(unfused.main_grad, before) and unfused.grad_added_to_main_grad is False
    assert unfused.grad.abs().sum() > 0


@pytest.mark.parametrize("tile_rows", [None, 9])
def test_token_log_probs_adds_into_main_grad_what_it_would_return(tile_rows):
    """token_log_probs (distillation's op) with gradient_accumulation_fusion: main_grad gets exactly the d_weight the
    op returns without it, and megatron's placeholder is returned: the same rule as the op it shares a weight with."""
    hidden, weight, labels, score_mask, g_lp, g_ent = _inputs()
    ids = torch.randint(0, TRUE_VOCAB, (N, 5), generator=torch.Generator().manual_seed(5))
    g_ids = torch.randn(N, 5, generator=torch.Generator().manual_seed(6))

    def run(param, fusion):
        out = token_log_probs(
            hidden, param, labels, ids, temperature=T, score_mask=score_mask, vocab_size=TRUE_VOCAB, backend="torch",
            tile_rows=tile_rows, gradient_accumulation_fusion=fusion,
        )  # fmt: skip
        ((out.log_probs * g_lp).sum() + (out.entropy * g_ent).sum() + (out.token_log_probs * g_ids).sum()).backward()

    returned = torch.nn.Parameter(weight.clone())
    run(returned, False)
    param = _as_ddp_parameter(weight)
    before = param.main_grad.clone()
    run(param, True)
    assert torch.allclose(param.main_grad - before, returned.grad, rtol=0, atol=1e-6 * returned.grad.abs().max())
    assert param.grad_added_to_main_grad is True and param.grad is not None and param.grad.shape == param.shape


def test_16_bit_main_grad_is_rounded_once():
    """A bf16 main_grad (grad_reduce_in_fp32=False): main_grad + d_weight rounded once, over one block or several."""
    hidden, weight, labels, score_mask, g_lp, g_ent = _inputs(torch.bfloat16)
    active = score_mask & (labels != -100)
    ref = reference_log_probs_entropy(
        hidden, weight, labels, temperature=T, vocab_size=TRUE_VOCAB, active=active, grad_outputs=(g_lp, g_ent)
    )[3]
    for tile_rows in (None, 9):
        param = _as_ddp_parameter(weight, torch.bfloat16)
        before = param.main_grad.clone()
        _run(hidden, param, labels, score_mask, g_lp, g_ent, True, tile_rows)
        exact = before.double() + ref
        assert param.main_grad.dtype == torch.bfloat16
        assert bool(((param.main_grad.double() - exact).abs() <= BF16_ROUNDING * exact.abs() + 1e-6).all())


def test_bad_main_grad_is_refused_at_the_call():
    hidden, weight, labels, score_mask, *_ = _inputs()
    bare = torch.nn.Parameter(weight.clone())
    with pytest.raises(ValueError, match="gradient_accumulation_fusion=True .* no main_grad"):
        log_probs_and_entropy(hidden, bare, labels, backend="torch", gradient_accumulation_fusion=True)
    for main_grad in (torch.zeros(V - 1, H), torch.zeros(V, H, dtype=torch.float64)):
        bare.main_grad = main_grad
        with pytest.raises(ValueError, match="must be shaped like the weight"):
            log_probs_and_entropy(hidden, bare, labels, backend="torch", gradient_accumulation_fusion=True)
    fsdp = _as_ddp_parameter(weight)
    fsdp.__fsdp_param__ = True
    with pytest.raises(ValueError, match="Megatron-FSDP parameter"):
        log_probs_and_entropy(hidden, fsdp, labels, backend="torch", gradient_accumulation_fusion=True)
    with pytest.raises(ValueError, match="gradient_accumulation_fusion: expected a bool"):
        log_probs_and_entropy(hidden, weight, labels, backend="torch", gradient_accumulation_fusion=1)
    # no gradient wanted (a reference model's forward, never DDP-wrapped): nothing to check
    del bare.main_grad
    with torch.no_grad():
        log_probs_and_entropy(hidden, bare, labels, backend="torch", gradient_accumulation_fusion=True)
    log_probs_and_entropy(hidden, weight, labels, backend="torch", gradient_accumulation_fusion=True)


def test_loss_inside_op_adds_the_scaled_gradient():
    """The fused loss computes d_weight in forward; its backward adds it, times d(result)/d(loss), into main_grad."""
    hidden, weight, labels, score_mask, g_lp, g_ent = _inputs()

    def loss_fn(log_probs, entropy):
        return (log_probs * g_lp.view(log_probs.shape)).sum() + (entropy * g_ent.view(entropy.shape)).sum(), {}

    results = {}
    for fusion in (False, True):
        param = _as_ddp_parameter(weight)
        h = hidden.clone().requires_grad_()
        out = log_probs_entropy_and_loss(
            h,
            param,
            labels,
            loss_fn=loss_fn,
            loss_name="test",
            temperature=T,
            score_mask=score_mask,
            vocab_size=TRUE_VOCAB,
            backend="torch",
            chunk_rows=16,
            gradient_accumulation_fusion=fusion,
        )
        (out.loss * 2.5).backward()
        results[fusion] = (param.main_grad + (0 if fusion else param.grad), h.grad, param.grad_added_to_main_grad)
    (unfused, d_hidden, flag_unfused), (fused, d_hidden_fused, flag_fused) = results[False], results[True]
    assert (fused - unfused).abs().max().item() <= FP32_RTOL * unfused.abs().max().item()
    assert torch.equal(d_hidden, d_hidden_fused) and flag_fused is True and flag_unfused is False


def _tp_worker(rank, world_size, hidden, weight, labels, score_mask, g_lp, g_ent):
    shard = V // world_size
    results = []
    for fusion in (False, True):
        param = _as_ddp_parameter(weight[rank * shard : (rank + 1) * shard], seed=20 + rank)
        before = param.main_grad.clone()
        h = hidden.clone().requires_grad_()
        lp, ent = log_probs_and_entropy(
            h,
            param,
            labels,
            temperature=T,
            tp_group=dist.group.WORLD,
            score_mask=score_mask,
            vocab_size=2 * shard - 3,
            backend="torch",
            tile_rows=13,
            gradient_accumulation_fusion=fusion,
        )
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        results.append((param.main_grad - before) if fusion else param.grad)
    return results[0], results[1], hidden.new_tensor(results[1].abs().max())


def test_tensor_parallel_ranks_add_their_own_shard():
    hidden, weight, labels, score_mask, g_lp, g_ent = _inputs()
    weight = weight[:42]  # two shards of 21 columns, the last 3 padding
    labels = labels.clamp(max=38)
    per_rank = run_in_processes(_tp_worker, 2, hidden, weight, labels, score_mask, g_lp, g_ent)
    for returned, added, scale in per_rank:
        assert (added - returned).abs().max().item() <= FP32_RTOL * scale.item()
    assert bool((per_rank[1][1][-3:] == 0).all())


def _ddp_worker(rank, world_size, tied, overlap):
    """Two micro-batches through the hook on a DDP-wrapped tiny GPTModel, without and with the output layer's
    gradient_accumulation_fusion (megatron's field, set on the built layer: its own fused linear needs a CUDA
    extension this machine lacks, and the hook never calls that linear)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from verl_fused_hook_harness.stand_ins.cuda_on_cpu import cuda_names_on_cpu
    from verl_fused_hook_harness.stand_ins.megatron_cpu import (
        build_cpu_gpt,
        init_model_parallel,
        tiny_transformer_config,
    )

    init_model_parallel(1)
    config = tiny_transformer_config()
    model = build_cpu_gpt(config, vocab_size=128, tied=tied)
    g = torch.Generator().manual_seed(2)
    batches = [
        (torch.randint(0, 120, (2, 16), generator=g), torch.randint(0, 120, (2, 16), generator=g)) for _ in range(2)
    ]
    position_ids = torch.arange(16).expand(2, 16)
    main_grads, flags = [], []
    with cuda_names_on_cpu():
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap)
        ddp = DistributedDataParallel(config, ddp_config, model)
        output_weight = ddp.module.shared_embedding_or_output_weight() if tied else ddp.module.output_layer.weight
        for fusion in (False, True):
            ddp.zero_grad_buffer()
            ddp.module.output_layer.gradient_accumulation_fusion = fusion
            for input_ids, labels in batches:
                context = FusedOutputProcessorContext(temperature=T, vocab_size=123)
                out = ddp(
                    input_ids=input_ids,
                    position_ids=position_ids,
                    attention_mask=None,
                    labels=labels,
                    output_processor=fused_output_processor,
                    output_processor_context=context,
                )
                (out.log_probs.sum() - 0.3 * out.entropy.sum()).backward()
                flags.append(output_weight.grad_added_to_main_grad)
            ddp.finish_grad_sync()
            main_grads.append({name: p.main_grad.clone() for name, p in ddp.module.named_parameters()})
    return main_grads, flags


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_hook_under_megatron_ddp(tied, overlap):
    (returned, fused), flags = run_in_processes(_ddp_worker, 1, tied, overlap)[0]
    assert flags == [False, False, True, True]
    assert sorted(returned) == sorted(fused) and len(returned) > 10
    for name, expected in returned.items():
        error = (fused[name] - expected).abs().max().item()
        assert error <= FP32_RTOL * expected.abs().max().item(), (name, error)


def _undistributed_worker(rank, world_size):
    """gradient_accumulation_fusion on a model never wrapped in DDP: megatron's layer returns its weight gradient
    then, and so does the hook, with a log line."""
    import logging

    from verl_fused_hook_harness.stand_ins.megatron_cpu import (
        build_cpu_gpt,
        init_model_parallel,
        tiny_transformer_config,
    )

    init_model_parallel(1)
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=128)
    model.output_layer.gradient_accumulation_fusion = True
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("verl_fused_hook.output_layer").addHandler(handler)
    logging.getLogger("verl_fused_hook.output_layer").setLevel(logging.INFO)
    ids = torch.randint(0, 120, (2, 16), generator=torch.Generator().manual_seed(1))
    out = model(
        input_ids=ids,
        position_ids=torch.arange(16).expand(2, 16),
        attention_mask=None,
        labels=ids,
        output_processor=fused_output_processor,
        output_processor_context=FusedOutputProcessorContext(),
    )
    out.log_probs.sum().backward()
    return model.output_layer.weight.grad is not None, [r.getMessage() for r in records]


def test_hook_without_ddp_returns_the_gradient_and_says_so():
    returned, messages = run_in_processes(_undistributed_worker, 1)[0]
    assert returned
    assert len(messages) == 1 and "no main_grad" in messages[0] and "d_weight is returned" in messages[0]


def test_hook_with_backend_verl_returns_the_gradient_on_every_call():
    """Backend "verl" computes d_weight in its own kernel: the rule answers no whatever the weight has, so no call of
    the step leaves a placeholder beside another's real gradient; nor for a Megatron-FSDP parameter."""
    from verl_fused_hook.output_layer import adds_weight_grad_to_main_grad

    layer = torch.nn.Module()
    layer.gradient_accumulation_fusion = True
    weight = _as_ddp_parameter(torch.zeros(4, 2))
    assert adds_weight_grad_to_main_grad(layer, weight, "auto") and adds_weight_grad_to_main_grad(
        layer, weight, "torch"
    )
    assert not adds_weight_grad_to_main_grad(layer, weight, "verl")
    weight.__fsdp_param__ = True  # Megatron-FSDP: its own hook makes main_grad
    assert not adds_weight_grad_to_main_grad(layer, weight, "auto")
    layer.gradient_accumulation_fusion = False
    assert not adds_weight_grad_to_main_grad(layer, weight, "auto")


@pytest.mark.parametrize("h, v", [(4096, 151936), (2048, 151936), (8192, 128256), (512, 300)])
def test_in_place_groups_keep_the_walk_within_its_budget(h, v):
    """With d_weight summed in place (an fp32 main_grad), the Triton backward's groups of rows (pure arithmetic,
    checked here on the CPU) cover every row once, in whole row blocks, and each group's walk (fp32 d_hidden and
    bf16 d_logits tile) fits IN_PLACE_WALK_BYTES at every N: the working memory does not grow with the tokens."""
    from verl_fused_hook.ops import backward_plan as t
    from verl_fused_hook.ops.backends.triton_backend import GRAD_CONFIG

    block_m, columns = GRAD_CONFIG.block_m, t.nominal_chunk_columns(v, GRAD_CONFIG.block_n)
    sizes = set()
    for n in (1, 127, 8192, 32768, 65536, 262144, 1_000_003):
        groups = t.row_groups(n, h, v, True, True, True, block_m=block_m, block_n=GRAD_CONFIG.block_n)
        assert groups[0].start == 0 and groups[-1].stop == n
        assert all(a.stop == b.start for a, b in zip(groups, groups[1:]))
        assert all((g.stop - g.start) % block_m == 0 for g in groups[:-1])
        largest = max(g.stop - g.start for g in groups)
        assert largest * (4 * h + 2 * columns) <= t.IN_PLACE_WALK_BYTES or largest == min(n, block_m)
        sizes.add(largest)
    assert max(sizes) * (4 * h + 2 * columns) <= t.IN_PLACE_WALK_BYTES
    # without d_weight wanted there is no sum to keep in place: the usual rule
    blocks = dict(block_m=block_m, block_n=GRAD_CONFIG.block_n)
    assert t.row_groups(262144, h, v, True, False, True, **blocks) == t.row_groups(262144, h, v, True, False, **blocks)
