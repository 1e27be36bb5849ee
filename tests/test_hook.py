"""fused_output_processor on real megatron-core GPTModels (CPU, gloo) against the default logits path.

For each scenario the same model runs twice: the default path (logits, gathered
over TP, then an fp64 log-softmax here) and the hook. Log-probs and entropy are
compared with the fp64 values, and every parameter gradient of a loss built
from them (sum of g1*log_prob + g2*entropy) is compared between the two paths.
"""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from verl_fused_hook import FusedOutputProcessorContext, fused_output_processor
from verl_fused_hook_harness.stand_ins.megatron_cpu import build_cpu_gpt, init_model_parallel, tiny_transformer_config
from verl_fused_hook_harness.support.distributed import run_in_processes

PADDED_VOCAB, TRUE_VOCAB, TEMPERATURE = 128, 123, 0.7
VALUE_ATOL = 2e-6  # hook log-prob/entropy vs fp64 of the default path's fp32 logits
GRAD_RTOL = 2e-6  # per-parameter gradient, relative to that gradient's largest entry

SCENARIOS = {
    # name: (tp, sequence_parallel, tied, layout, mup)
    "tp1_untied_padded": (1, False, False, "padded", False),
    "tp1_tied_thd_mup": (1, False, True, "thd", True),
    "tp2_untied_padded": (2, False, False, "padded", False),
    "tp2_tied_thd": (2, False, True, "thd", False),
    "tp2_sp_untied_thd": (2, True, False, "thd", False),
    "tp2_sp_tied_padded_mup": (2, True, True, "padded", True),
    "tp4_sp_untied_thd": (4, True, False, "thd", False),
    "tp4_tied_padded": (4, False, True, "padded", False),
}


def make_batch(layout):
    generator = torch.Generator().manual_seed(5)
    if layout == "padded":  # b=2, right-padded to 16, second sequence 11 tokens long
        lengths, seq = torch.tensor([16, 11]), 16
        ids = torch.randint(0, TRUE_VOCAB, (2, seq), generator=generator)
        labels = torch.randint(0, TRUE_VOCAB, (2, seq), generator=generator)
        position_ids = torch.arange(seq).expand(2, seq)
        valid = torch.arange(seq)[None, :] < lengths[:, None]
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        attention_mask = (causal[None] | ~valid[:, None, :])[:, None]  # True = masked
        return dict(input_ids=ids, position_ids=position_ids, attention_mask=attention_mask, labels=labels), valid
    # THD: three packed sequences (5, 7, 8 tokens) in one row; the first 2 tokens of each are "prompt"
    cu_seqlens = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    ids = torch.randint(0, TRUE_VOCAB, (1, 20), generator=generator)
    labels = torch.randint(0, TRUE_VOCAB, (1, 20), generator=generator)
    position_ids = torch.cat([torch.arange(n) for n in (5, 7, 8)])[None]
    scored = position_ids >= 2
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=8, max_seqlen_kv=8
    )
    return dict(
        input_ids=ids, position_ids=position_ids, attention_mask=None, labels=labels, packed_seq_params=packed
    ), scored


def reference_from_logits(logits, labels, scored):
    """fp64 log-softmax at the label and entropy, over the true vocabulary."""
    log_softmax = torch.log_softmax(logits[..., :TRUE_VOCAB].double() / TEMPERATURE, dim=-1)
    log_probs = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1) * scored
    entropy = -(log_softmax.exp() * log_softmax).sum(-1) * scored
    return log_probs, entropy


def parameter_grads(model):
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def compare_scenario(name):
    tp, sp, tied, layout, mup = SCENARIOS[name]
    init_model_parallel(tp)
    config = tiny_transformer_config(sequence_parallel=sp, use_mup=mup, num_query_groups=4 if tp == 4 else 2)
    model = build_cpu_gpt(config, vocab_size=PADDED_VOCAB, tied=tied)
    batch, scored = make_batch(layout)
    generator = torch.Generator().manual_seed(9)
    g_log_probs, g_entropy = (
        torch.randn(scored.shape, generator=generator),
        torch.randn(scored.shape, generator=generator),
    )
    labels = batch.pop("labels")

    logits = model(**batch)  # [b, s, V/tp]
    logits = gather_from_tensor_model_parallel_region(logits) if tp > 1 else logits
    ref_log_probs, ref_entropy = reference_from_logits(logits, labels, scored)
    (ref_log_probs * g_log_probs + ref_entropy * g_entropy).sum().backward()
    default_grads = parameter_grads(model)

    context = FusedOutputProcessorContext(temperature=TEMPERATURE, vocab_size=TRUE_VOCAB, score_mask=scored)
    output = model(**batch, labels=labels, output_processor=fused_output_processor, output_processor_context=context)
    (output.log_probs * g_log_probs + output.entropy * g_entropy).sum().backward()
    hook_grads = parameter_grads(model)

    grad_errors = {
        key: ((hook_grads[key] - grad).abs().max() / grad.abs().max().clamp_min(1e-30)).item()
        for key, grad in default_grads.items()
    }
    return {
        "log_probs": (output.log_probs.double() - ref_log_probs).abs().max().item(),
        "entropy": (output.entropy.double() - ref_entropy).abs().max().item(),
        "shape": tuple(output.log_probs.shape),
        "dtype": output.log_probs.dtype,
        "unscored_zero": bool((output.log_probs[~scored] == 0).all() and (output.entropy[~scored] == 0).all()),
        "grad_errors": grad_errors,
        "same_grad_names": sorted(default_grads) == sorted(hook_grads),
    }


def scenarios_worker(rank, world_size, names):
    return {name: compare_scenario(name) for name in names}


@pytest.fixture(scope="module")
def scenario_results():
    results = run_in_processes(scenarios_worker, 1, [n for n in SCENARIOS if SCENARIOS[n][0] == 1])[0]
    for tp in (2, 4):
        per_rank = run_in_processes(scenarios_worker, tp, [n for n in SCENARIOS if SCENARIOS[n][0] == tp])
        for name in per_rank[0]:
            results[name] = [rank_results[name] for rank_results in per_rank]
    return results


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_hook_matches_default_path(name, scenario_results):
    per_rank = scenario_results[name]
    per_rank = per_rank if isinstance(per_rank, list) else [per_rank]
    for rank, result in enumerate(per_rank):
        expected_shape = (2, 16) if SCENARIOS[name][3] == "padded" else (1, 20)
        assert result["shape"] == expected_shape and result["dtype"] == torch.float32
        assert result["log_probs"] <= VALUE_ATOL, (rank, result["log_probs"])
        assert result["entropy"] <= VALUE_ATOL, (rank, result["entropy"])
        assert result["unscored_zero"]
        assert result["same_grad_names"] and len(result["grad_errors"]) > 10
        worst = max(result["grad_errors"], key=result["grad_errors"].get)
        assert result["grad_errors"][worst] <= GRAD_RTOL, (rank, worst, result["grad_errors"][worst])


def mtp_worker(rank, world_size):
    """MTP's loss is attached to the hidden states before the hook: its gradient must survive the hook."""
    init_model_parallel(1)
    model = build_cpu_gpt(tiny_transformer_config(mtp_num_layers=1), vocab_size=PADDED_VOCAB)
    batch, _ = make_batch("padded")
    batch["loss_mask"] = torch.ones_like(batch["labels"], dtype=torch.float32)

    # Default path: Megatron's own LM loss (per-token CE) + MTP loss.
    loss = model(**batch)
    loss.sum().backward()
    default = parameter_grads(model)

    output = model(
        **batch,
        output_processor=fused_output_processor,
        output_processor_context=FusedOutputProcessorContext(temperature=1.0),
    )
    (-output.log_probs).sum().backward()  # the same CE loss, from the hook's log-probs
    hooked = parameter_grads(model)
    return {name: (default[name], hooked.get(name)) for name in default}


def test_mtp_gradient_reaches_the_model():
    grads = run_in_processes(mtp_worker, 1)[0]
    mtp_names = [name for name in grads if name.startswith("mtp.")]
    assert len(mtp_names) > 5
    for name, (default, hooked) in grads.items():
        assert hooked is not None, f"{name} got no gradient through the hook"
        error = ((hooked - default).abs().max() / default.abs().max().clamp_min(1e-30)).item()
        assert error <= GRAD_RTOL, (name, error)
    assert all(grads[name][1].abs().sum() > 0 for name in mtp_names)


def schedule_plan_worker(rank, world_size):
    init_model_parallel(1)
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=PADDED_VOCAB)
    batch, scored = make_batch("padded")
    context = FusedOutputProcessorContext(temperature=TEMPERATURE, vocab_size=TRUE_VOCAB, as_tuple=True)
    direct = model(**batch, output_processor=fused_output_processor, output_processor_context=context)
    hidden_states = model(**batch, output_processor=lambda **kwargs: kwargs["hidden_states"])
    plan = model.build_schedule_plan(**batch, output_processor=fused_output_processor, output_processor_context=context)
    plan.pre_process.forward_impl()
    planned = plan.post_process.forward_impl(hidden_states)
    return direct, planned


def test_schedule_plan_threads_the_processor_and_gets_tensors():
    direct, planned = run_in_processes(schedule_plan_worker, 1)[0]
    assert isinstance(planned, tuple) and all(isinstance(t, torch.Tensor) for t in planned)
    assert len(planned) == 2 and torch.equal(planned[0], direct[0]) and torch.equal(planned[1], direct[1])


def pipeline_worker(rank, world_size):
    init_model_parallel(1)
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=PADDED_VOCAB, post_process=False)
    batch, _ = make_batch("padded")
    calls = []

    def recording_processor(**kwargs):
        calls.append(kwargs)
        return fused_output_processor(**kwargs)

    out = model(**batch, output_processor=recording_processor, output_processor_context=FusedOutputProcessorContext())
    return tuple(out.shape), len(calls)


def test_pipeline_stage_without_post_process_returns_hidden_states():
    shape, calls = run_in_processes(pipeline_worker, 1)[0]
    assert shape == (16, 2, 64) and calls == 0
