"""Hook mode's MTP on real megatron-core GPTModels with MTP layers (CPU, gloo) against verl's unfused path.

verl's path is its MTP `_postprocess` patch (verl/models/mcore/mtp_patch.py), which calls
megatron-core's own `process_mtp_loss` (MTP logits through the output layer) and returns
main-head logits; the main log-probs come from them with verl's
`vocab_parallel_log_probs_from_logits`. Hook mode runs the same model through the plugin's
`patch_postprocess` wrapper: the main head through `fused_output_processor`, the MTP loss
through `fused_process_mtp_loss`. Compared: main log-probs, the logged MTP loss and
acceptance counts, and every parameter gradient of sum(g * log_probs) (which carries the
injected MTP loss).
"""

import dataclasses

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from table_titles import assert_every_table_names

from verl_fused_hook_harness.support.distributed import run_in_processes

VOCAB, TEMPERATURE = 160, 0.7
RTOL = 1e-5  # fp32: values and every gradient, relative to the reference's largest magnitude

SCENARIOS = {
    # name: (tp, sequence_parallel, tied, layout, mtp layers, extras)
    "tp1_untied_padded_1": (1, False, False, "padded", 1, {}),
    "tp1_tied_thd_2_mup_detach": (1, False, True, "thd", 2, {"use_mup": True, "mtp_detach_heads": True}),
    "tp1_untied_thd_2_per_token": (1, False, False, "thd", 2, {"per_token": True, "factor": 0.8}),
    "tp2_untied_thd_2": (2, False, False, "thd", 2, {}),
    "tp2_tied_padded_1": (2, False, True, "padded", 1, {}),
    "tp2_sp_tied_thd_1": (2, True, True, "thd", 1, {}),
    "tp2_sp_untied_padded_2_per_token": (2, True, False, "padded", 2, {"per_token": True}),
}


def make_batch(layout):
    generator = torch.Generator().manual_seed(5)
    if layout == "padded":  # b=2, s=16, the second sequence 11 tokens long
        lengths, seq = torch.tensor([16, 11]), 16
        ids = torch.randint(0, VOCAB, (2, seq), generator=generator)
        valid = torch.arange(seq)[None, :] < lengths[:, None]
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        attention_mask = (causal[None] | ~valid[:, None, :])[:, None]  # True = masked
        position_ids = torch.arange(seq).expand(2, seq)
        loss_mask = (valid & (torch.arange(seq)[None, :] >= 3)).float()
        batch = dict(input_ids=ids, position_ids=position_ids, attention_mask=attention_mask)
    else:  # THD: three packed sequences (5, 7, 8 tokens), the first 2 of each a prompt
        cu_seqlens = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
        ids = torch.randint(0, VOCAB, (1, 20), generator=generator)
        position_ids = torch.cat([torch.arange(n) for n in (5, 7, 8)])[None]
        loss_mask = (position_ids >= 2).float()
        packed = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens, max_seqlen_q=8, max_seqlen_kv=8
        )
        batch = dict(input_ids=ids, position_ids=position_ids, attention_mask=None, packed_seq_params=packed)
    loss_mask[0, 7] = 0  # a hole inside a response (tool output)
    labels = torch.roll(ids, -1, dims=1)  # the label ids' values only matter, not their source
    return batch, labels, loss_mask


def tracker_snapshot():
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    snapshot = {
        key: tracker[key].clone() for key in ("loss_values", "correct_values", "total_values") if key in tracker
    }
    tracker.clear()  # scenarios differ in MTP layer count, and the tracker sizes itself once
    return snapshot


def parameter_grads(model):
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def relative_error(got, want):
    scale = want.double().abs().max().clamp_min(1e-30)
    return ((got.double() - want.double()).abs().max() / scale).item()


def compare_scenario(name, verl_patch):
    from verl.models.mcore import mtp_patch
    from verl.utils.megatron.tensor_parallel import vocab_parallel_log_probs_from_logits

    from verl_fused_hook import FusedOutputProcessorContext, fused_output_processor
    from verl_fused_hook.switch import HOOK, FusedForwardPlan
    from verl_fused_hook.verl_integration.model_plan import set_plan
    from verl_fused_hook.verl_integration.mtp import set_mtp_training
    from verl_fused_hook_harness.stand_ins.megatron_cpu import build_cpu_gpt, tiny_transformer_config

    tp, sp, tied, layout, mtp_layers, extras = SCENARIOS[name]
    config = tiny_transformer_config(
        sequence_parallel=sp, mtp_num_layers=mtp_layers, use_mup=extras.get("use_mup", False)
    )
    config.mtp_loss_scaling_factor = 0.3
    config.calculate_per_token_loss = extras.get("per_token", False)
    if "mtp_detach_heads" in extras:  # a field from megatron-core 0.19 on: replace() refuses it where it is missing
        config = dataclasses.replace(config, mtp_detach_heads=extras["mtp_detach_heads"])
    model = build_cpu_gpt(config, vocab_size=VOCAB, tied=tied)
    batch, labels, loss_mask = make_batch(layout)
    if "factor" in extras:  # verl's mtp_loss_normalization_factor travels on the packed params (THD only)
        batch["packed_seq_params"]._verl_mtp_loss_normalization_factor = extras["factor"]
    grad_out = torch.randn(labels.shape, generator=torch.Generator().manual_seed(9))
    tracker_snapshot()

    output_layer_calls = []
    model.output_layer.register_forward_hook(lambda module, args, out: output_layer_calls.append(args[0].shape))

    def verl_path(train):
        output_layer_calls.clear()
        verl_patch(model)
        kwargs = dict(labels=labels, loss_mask=loss_mask) if train else {}
        logits = model(**batch, **kwargs)
        if config.use_mup:  # verl's patch returns the main head's logits without megatron's MuP scale
            logits = model._scale_logits(logits)
        log_probs = vocab_parallel_log_probs_from_logits(logits / TEMPERATURE, labels)
        (log_probs * grad_out).sum().backward()
        mtp_patch.unpatch_postprocess(model)
        assert len(output_layer_calls) == 1 + (mtp_layers if train else 0)  # main + MTP logits
        return log_probs.detach(), parameter_grads(model), tracker_snapshot()

    def hook_path(train):
        output_layer_calls.clear()
        set_plan(model, FusedForwardPlan(mode=HOOK, backend="torch", source="test"))
        set_mtp_training(model, train)
        mtp_patch.patch_postprocess(model)  # the plugin's wrapper (install_call_sites ran)
        output = model(
            **batch,
            labels=labels,
            loss_mask=loss_mask if train else None,
            output_processor=fused_output_processor,
            output_processor_context=FusedOutputProcessorContext(temperature=TEMPERATURE, backend="torch"),
        )
        (output.log_probs * grad_out).sum().backward()
        mtp_patch.unpatch_postprocess(model)
        set_plan(model, None)
        assert not output_layer_calls, "hook mode must build no logits, main head or MTP"
        return output.log_probs.detach(), parameter_grads(model), tracker_snapshot()

    result = {}
    for train in (True, False):
        (ref_lp, ref_grads, ref_metrics), (lp, grads, metrics) = verl_path(train), hook_path(train)
        result[train] = dict(
            log_probs=relative_error(lp, ref_lp),
            grad_names=(sorted(grads), sorted(ref_grads)),
            grad_errors={key: relative_error(grads[key], ref_grads[key]) for key in ref_grads if key in grads},
            metrics={key: (metrics.get(key), value) for key, value in ref_metrics.items()},
            mtp_grads=sum(1 for key in grads if key.startswith("mtp.")),
        )
    return result


def scenarios_worker(rank, world_size, names):
    from verl.models.mcore import mtp_patch

    from verl_fused_hook.verl_integration import call_sites
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel

    init_model_parallel(world_size)
    call_sites.install_call_sites()
    verl_patch = call_sites.original(mtp_patch, "patch_postprocess")
    return {name: compare_scenario(name, verl_patch) for name in names}


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def results(request):
    names = [name for name, scenario in SCENARIOS.items() if scenario[0] == request.param]
    per_rank = run_in_processes(scenarios_worker, request.param, names)
    return {name: [rank_result[name] for rank_result in per_rank] for name in names}


def _scenario_results(results, name):
    if name not in results:
        pytest.skip(f"{name} runs in the other tensor-parallel fixture")
    return results[name]


@pytest.mark.parametrize("name", SCENARIOS)
def test_mtp_loss_metrics_and_gradients_match_verls_path(results, name):
    for rank, result in enumerate(_scenario_results(results, name)):
        trained = result[True]
        assert trained["log_probs"] <= RTOL, (rank, trained["log_probs"])
        names, ref_names = trained["grad_names"]
        assert names == ref_names, f"rank {rank}: parameters with gradients differ"
        assert trained["mtp_grads"] > 3, "the MTP layers must train"
        worst = max(trained["grad_errors"], key=trained["grad_errors"].get)
        assert trained["grad_errors"][worst] <= RTOL, (rank, worst, trained["grad_errors"][worst])
        assert set(trained["metrics"]) == {"loss_values", "correct_values", "total_values"}
        for key, (got, want) in trained["metrics"].items():
            assert got is not None and got.shape == want.shape, key
            assert relative_error(got, want) <= RTOL, (rank, key, got, want)
        assert trained["metrics"]["total_values"][1].min() > 0


@pytest.mark.parametrize("name", SCENARIOS)
def test_mtp_not_trained_runs_no_mtp_like_verls_path(results, name):
    for rank, result in enumerate(_scenario_results(results, name)):
        untrained = result[False]
        assert untrained["log_probs"] <= RTOL, (rank, untrained["log_probs"])
        names, ref_names = untrained["grad_names"]
        assert names == ref_names and untrained["mtp_grads"] == 0
        worst = max(untrained["grad_errors"], key=untrained["grad_errors"].get)
        assert untrained["grad_errors"][worst] <= RTOL, (rank, worst, untrained["grad_errors"][worst])
        for key, (got, want) in untrained["metrics"].items():
            assert not bool(want.any()) and (got is None or not bool(got.any())), key


# ---------------------------------------------------------------- through verl's engine (build step and forward_step)

PROMPT_LENS, RESPONSE_LENS = (4, 6, 3), (5, 2, 7)


def rl_batch(vocab):
    from verl.utils import tensordict_utils as tu

    def nested(parts):
        return torch.nested.as_nested_tensor(list(parts), layout=torch.jagged)

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=generator) for n in PROMPT_LENS]
    responses = [torch.randint(0, vocab, (n,), generator=generator) for n in RESPONSE_LENS]
    loss_mask = [torch.cat([torch.zeros(len(p)), torch.ones(len(r))]).long() for p, r in zip(prompts, responses)]
    loss_mask[0][6] = 0  # a tool-output token inside a response
    return tu.get_tensordict(
        {
            "input_ids": nested(torch.cat(pair) for pair in zip(prompts, responses)),
            "loss_mask": nested(loss_mask),
            "prompts": nested(prompts),
            "responses": nested(responses),
            "temperature": torch.full((len(PROMPT_LENS),), 0.7),
        },
        non_tensor_dict={"calculate_entropy": True},
    )


def engine_steps_worker(rank, world_size, switch):
    """MTP engines built and stepped as verl does (build gate, patch_engine_mtp, forward_step, backward),
    with mtp.enable_train True and False, in one process with the switch set or unset."""
    import logging
    import os

    from verl_fused_hook.switch import ENV_VAR
    from verl_fused_hook.verl_integration import install
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel

    if switch:
        os.environ[ENV_VAR] = "1"
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("verl_fused_hook").addHandler(handler)
    logging.getLogger("verl_fused_hook").setLevel(logging.INFO)
    install()
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401  (fires the plugin's build gate)

    init_model_parallel(1)
    steps = {train: engine_step(switch, train, records) for train in (True, False)}
    if switch:  # legacy mode (verl's monkey-patched forward) keeps verl's MTP disable
        from verl_fused_hook_harness.stand_ins.megatron_cpu import build_cpu_gpt, tiny_transformer_config
        from verl_fused_hook_harness.support.verl_engine import megatron_engine

        os.environ[ENV_VAR] = "0"
        legacy = megatron_engine(
            [build_cpu_gpt(tiny_transformer_config(mtp_num_layers=1), vocab_size=VOCAB)], mtp_enable=True
        )
        legacy._maybe_enable_fused_kernels()
        steps["legacy_fused"] = legacy.engine_config.use_fused_kernels
    return steps


def engine_step(switch, enable_train, records):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    from verl.utils.megatron_utils import patch_engine_mtp

    from verl_fused_hook_harness.stand_ins.megatron_cpu import build_cpu_gpt, tiny_transformer_config
    from verl_fused_hook_harness.support.verl_engine import megatron_engine

    records.clear()
    MTPLossLoggingHelper.tracker.clear()
    config = tiny_transformer_config(mtp_num_layers=1)
    config.mtp_loss_scaling_factor = 0.3
    model = build_cpu_gpt(config, vocab_size=VOCAB)
    engine = megatron_engine(
        [model],
        fused_kernel_options={"output_processor_backend": "torch"} if switch else None,
        mtp_enable=True,
        mtp_enable_train=enable_train,
    )
    engine._maybe_enable_fused_kernels()
    patch_engine_mtp(engine.module, engine.model_config)  # what verl's initialize does next
    batch = rl_batch(VOCAB)
    output, _ = engine.forward_step(iter([batch]), model, None, lambda output, **_: output)
    log_probs = output["log_probs"]
    response_rows = torch.cat([torch.arange(p + r) >= p - 1 for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]) & torch.cat(
        [torch.arange(p + r) < p + r - 1 for p, r in zip(PROMPT_LENS, RESPONSE_LENS)]
    )
    values = log_probs.values() * response_rows
    grad_out = torch.randn(values.shape, generator=torch.Generator().manual_seed(3))
    (values * grad_out).sum().backward()
    tracker = {
        key: MTPLossLoggingHelper.tracker[key].clone()
        for key in ("loss_values", "correct_values", "total_values")
        if key in MTPLossLoggingHelper.tracker
    }
    return dict(
        fused=engine.engine_config.use_fused_kernels,
        log_probs=values.detach(),
        grads={name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None},
        tracker=tracker,
        logs=list(records),
    )


@pytest.fixture(scope="module")
def engine_runs():
    return run_in_processes(engine_steps_worker, 1, False)[0], run_in_processes(engine_steps_worker, 1, True)[0]


@pytest.fixture(params=[True, False], ids=["train", "no_train"])
def engine_steps(request, engine_runs):
    verl_as_shipped, hook = engine_runs
    return request.param, verl_as_shipped[request.param], hook[request.param]


def test_switch_unset_keeps_verls_mtp_disable(engine_steps):
    _, verl_as_shipped, _ = engine_steps
    assert verl_as_shipped["fused"] is False
    assert not any("keeps fused kernels on with MTP" in line for line in verl_as_shipped["logs"])


def test_legacy_mode_keeps_verls_mtp_disable(engine_runs):
    assert engine_runs[1]["legacy_fused"] is False


def test_hook_mode_keeps_fused_kernels_on_with_mtp_and_says_so(engine_steps):
    train, _, hook = engine_steps
    assert hook["fused"] is True
    lines = [line for line in hook["logs"] if "keeps fused kernels on with MTP" in line]
    assert len(lines) == 1 and f"mtp.enable_train={train}" in lines[0], hook["logs"]


def test_engine_step_matches_verls_unfused_mtp_path(engine_steps):
    train, verl_as_shipped, hook = engine_steps
    assert relative_error(hook["log_probs"], verl_as_shipped["log_probs"]) <= RTOL
    assert sorted(hook["grads"]) == sorted(verl_as_shipped["grads"])
    assert any(name.startswith("mtp.") for name in hook["grads"]) == train
    for name, want in verl_as_shipped["grads"].items():
        assert relative_error(hook["grads"][name], want) <= RTOL, name
    assert set(hook["tracker"]) == set(verl_as_shipped["tracker"])
    for key, want in verl_as_shipped["tracker"].items():
        assert relative_error(hook["tracker"][key], want) <= RTOL, key
    assert bool(verl_as_shipped["tracker"]["total_values"].gt(0).all()) if train else not verl_as_shipped["tracker"]


# ---------------------------------------------------------------- the A/B script's MTP scenario, the e2e bench's MTP
# option


def test_ab_parity_mtp_scenario_on_cpu(tmp_path):
    import json

    from verl_fused_hook_harness.commands.ab import parity as ab_parity

    out = tmp_path / "ab_mtp.json"
    code = ab_parity.main(
        ["--device", "cpu", "--scenarios", "tp1/nosp/untied", "--mtp-layers", "2", "--json", str(out)]
    )
    report = json.loads(out.read_text())
    assert code == 0 and report["match"] and report["mtp_layers"] == 2
    (entry,) = report["scenarios"]
    assert entry["fused"] == {"verl": False, "hook": True}
    assert all(
        entry["vs_verl_rel"][k] <= ab_parity.UNFUSED_RTOL for k in ("log_probs", "entropy", "policy_loss", "grads")
    )
    assert entry["mtp"]["mtp_loss"] <= ab_parity.UNFUSED_RTOL and entry["mtp"]["acceptance_gap"] == 0


def test_ab_parity_refuses_negative_mtp_layers(capsys):
    from verl_fused_hook_harness.commands.ab import parity as ab_parity

    with pytest.raises(SystemExit):
        ab_parity.main(["--device", "cpu", "--mtp-layers", "-1"])
    assert "--mtp-layers" in capsys.readouterr().err


def _e2e_mtp_worker(rank, world_size, out):
    from megatron.core.models.gpt import gpt_model
    from verl.models.mcore import mtp_patch

    from verl_fused_hook_harness.commands.e2e import bench as e2e_bench

    def call_sites():
        return gpt_model.process_mtp_loss, mtp_patch._process_mtp_loss

    before = call_sites()
    code = e2e_bench.main(
        [
            "--mtp",
            "1",
            "--device",
            "cpu",
            "--hf-config",
            "verl_fused_hook_harness/configs/tiny_qwen2",
            "--vocab-size",
            "1000",
            "--sizes",
            "256",
            "--warmups",
            "1",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    # the probe put back what it wrapped (the plugin's replacement, installed by the bench, stays)
    return code, [a is b or getattr(a, "__wrapped__", None) is b for a, b in zip(call_sites(), before)]


def test_e2e_bench_mtp_option_on_cpu(tmp_path):
    import json

    from verl_fused_hook_harness.commands.e2e.mtp import SIDES

    code, restored = run_in_processes(_e2e_mtp_worker, 1, tmp_path)[0]
    assert code == 0 and all(restored)
    report = json.loads((tmp_path / "e2e_mtp.json").read_text())
    assert report["vocab_size"] == 1000 and report["mtp_layers"] == 1
    (entry,) = report["sizes"]
    assert [row["side"] for row in entry["sides"]] == list(SIDES)
    assert {row["side"]: row["fused_kernels"] for row in entry["sides"]} == {"hook": True, "verl": False}
    assert all(row["train_s"] > 0 and row["train_peak_bytes"] > 0 for row in entry["sides"])
    parity = entry["hook_vs_verl"]
    assert parity["same_parameters"] and parity["grads_rel"] <= RTOL and parity["log_probs"] <= RTOL
    assert parity["mtp_loss"] <= RTOL and parity["acceptance_correct"] == 0
    table = (tmp_path / "e2e_mtp.md").read_text()
    assert_every_table_names(table, "cpu", 2)  # the step, the output layer's memory
    assert "| 256 | hook | True |" in table

    # the output layer's own memory, measured inside the real step (figures n/a on the CPU)
    hidden, vocab = 128, 1024  # tiny_qwen2's hidden size; the vocabulary 1000 padded to a multiple of 128
    sites = {
        "hook": "verl_fused_hook.verl_integration.mtp.make_process_mtp_loss.<locals>.process_mtp_loss",
        "verl": "megatron.core.transformer.multi_token_prediction.process_mtp_loss",
    }
    for row in entry["sides"]:
        head = row["output_layer"]
        assert head["calls"] == [sites[row["side"]]], head["calls"]
        assert head["hidden_rows"] == 2 * 256  # main + one MTP layer's hidden states, concatenated
        assert head["hidden_grad_bytes"] == 2 * 256 * hidden * 4 and head["weight_grad_bytes"] == vocab * hidden * 4
        assert (
            set(head["scored_rows"]) == {"main", "mtp1"}
            and 0 < head["scored_rows"]["mtp1"] <= head["scored_rows"]["main"] < 256
        )
        assert head["accumulator_bytes"] == 4 * hidden * head["scored_rows"]["main"]
        assert head["target_bytes"] == int(1.5 * 2**30) + head["accumulator_bytes"]
        assert head["split_backward_bytes"] == head["hidden_grad_bytes"]
        for key in ("extra_bytes", "within_target", "extra_without_split_bytes", "within_target_without_split"):
            assert head[key] is None, key  # CUDA memory statistics only
    assert "| 256 | hook | n/a | n/a |" in table
