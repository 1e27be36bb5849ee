"""What `--layer-spec te` builds and runs, on the CPU, where Transformer Engine cannot: its spec is the one thing faked.

TEST-ONLY FAKES, named as such: mbridge's `_get_transformer_layer_spec` (which hard-codes TE's layer spec) returns
the CPU layer spec, and e2e-bench's spec decision accepts `te` on the CPU. Everything else is what the `te` path
runs on a GPU: train-parity's engines through verl's `make_megatron_module` and mbridge's `get_model` (the plugin's
mbridge_compat fix, DDP, seeded weights) and their GRPO steps; e2e-bench with two specs' models in one run, their
steps and the decoder alone in the same rounds, and the table that sets them side by side (no timing asserted).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from table_titles import assert_every_table_names

from verl_fused_hook_harness.support.distributed import run_in_processes

ROOT = Path(__file__).resolve().parent.parent


def _fake_te_spec() -> list:
    """mbridge's TE layer spec replaced by the CPU spec (a fake: TE cannot run here); returns the list of its calls."""
    from mbridge.core.llm_bridge import LLMBridge

    from verl_fused_hook_harness.stand_ins.megatron_cpu import cpu_block_spec

    calls = []

    def cpu_spec_in_place_of_te(self, vp_stage=None):
        calls.append(vp_stage)
        return cpu_block_spec(self.config, vp_stage)

    LLMBridge._get_transformer_layer_spec = cpu_spec_in_place_of_te
    return calls


def _mbridge_build_worker(rank, world_size, folder):
    from verl_fused_hook_harness.commands.train.modes import MODES
    from verl_fused_hook_harness.commands.train.runs import Plan, prepare_process, run_steps
    from verl_fused_hook_harness.support.grpo_batches import RolloutShape
    from verl_fused_hook_harness.support.hf_model import TINY_QWEN2
    from verl_fused_hook_harness.support.train_engine import EngineSetup, build_engine

    calls = _fake_te_spec()
    shape = RolloutShape(prompts=2, n=5, prompt_lengths=(3, 9), response_lengths=(2, 10))
    plan = Plan(
        hf_path=str(TINY_QWEN2), device="cpu", tp=1, dtype="float32", steps=2, shape=shape, micro_batch=5,
        seed=1234, modes=("legacy", "hook-auto"), offload=(False,), offload_modes=(), deterministic=True,
        checkpoint_root=folder, out=folder, layer_spec="te",
    )  # fmt: skip
    prepare_process(plan, rank)
    runs = {name: run_steps(plan, MODES[name], False, first=1, save=False, load=False)[0] for name in plan.modes}
    from verl_fused_hook_harness.stand_ins.cuda_on_cpu import cuda_names_on_cpu

    with cuda_names_on_cpu():
        setup = EngineSetup(
            hf_path=str(TINY_QWEN2), tp=1, dtype="float32", seed=1234, micro_batch_size=5, total_steps=2, lr=1e-4,
            offload=False, fused_kernel_options={}, layer_spec="te",
        )  # fmt: skip
        engine = build_engine(setup)
    return {
        "spec_calls": len(calls),
        "wrapper": type(engine.module[0]).__name__,
        "steps": {
            name: [(r["loss"], r["grad_norm"], r["param_checksum"]) for r in rows] for name, rows in runs.items()
        },
    }


def test_te_engines_build_through_verl_and_mbridge_and_train():
    with tempfile.TemporaryDirectory() as folder:
        result = run_in_processes(_mbridge_build_worker, 1, folder)[0]
    # two runs of an actor and a reference, then one more engine: each asked mbridge for its layer spec
    assert result["spec_calls"] == 5, result
    assert result["wrapper"] == "DistributedDataParallel"  # mbridge's get_model wrapped it, as verl's build does
    legacy, hook = result["steps"]["legacy"], result["steps"]["hook-auto"]
    assert len(legacy) == 2 and all(loss is not None for loss, _, _ in legacy)
    # seeded weights: every build the same model; one kernel on the CPU: both modes train identically
    assert legacy == hook, result


def _two_specs_worker(rank, world_size, out):
    from verl_fused_hook_harness.commands.e2e import bench, layer_specs
    from verl_fused_hook_harness.support.layer_spec import SpecChoice

    _fake_te_spec()
    layer_specs.resolve_layer_spec = lambda parser, spec, device: SpecChoice(spec, "test fake: the CPU spec for TE's")
    return bench.main(
        [
            "--device", "cpu", "--hf-config", str(ROOT / "verl_fused_hook_harness/configs/tiny_qwen2"),
            "--modes", "legacy,hook+ours", "--sizes", "128", "--warmups", "1", "--repeats", "2",
            "--layer-specs", "local,te", "--output-layer-share", "--out", str(out),
        ]
    )  # fmt: skip


def test_two_specs_and_the_decoder_alone_in_one_run(tmp_path):
    assert run_in_processes(_two_specs_worker, 1, tmp_path)[0] == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert report["layer_specs"] == ["local", "te"]
    assert report["layer_spec_reasons"]["te"] == "test fake: the CPU spec for TE's"
    assert [entry["layer_spec"] for entry in report["sizes"]] == ["local", "te"]
    for entry in report["sizes"]:
        rows = {row["mode"]: row for row in entry["modes"]}
        assert rows["hook+ours"]["vs_legacy"]["grads_max_abs"] == 0.0  # each spec's own reference
        decoder = entry["decoder_only"]
        assert len(decoder["train_times_s"]) == len(decoder["forward_times_s"]) == 2  # timed in the rounds
        for row in rows.values():
            assert row["layer_spec"] == entry["layer_spec"] and len(row["train_times_s"]) == 2
            share = row["output_layer_share"]
            assert share["train"] == 1 - decoder["train_s"] / row["train_s"]
            assert share["forward"] == 1 - decoder["forward_s"] / row["forward_s"]
    table = (tmp_path / "e2e.md").read_text()
    assert "| 128 (8), local | legacy |" in table and "| 128 (8), te | hook+ours |" in table
    assert_every_table_names(table, "cpu", 2)  # the modes' table, the specs' table
    spec_lines = table.split("\n\n")[3].splitlines()
    assert spec_lines[0] == (
        "| tokens | mode | local fwd+bwd | te fwd+bwd | local output layer share | te output layer share | te / local "
        "| local no-grad fwd | te no-grad fwd | local output layer share | te output layer share | te / local |"
    )
    assert [line.split(" | ")[1] for line in spec_lines[2:]] == ["legacy", "hook+ours", "decoder only"]


def _main_grad_worker(rank, world_size, out):
    from verl_fused_hook_harness.commands.e2e import bench, common, layer_specs
    from verl_fused_hook_harness.stand_ins.cuda_on_cpu import cuda_names_on_cpu
    from verl_fused_hook_harness.support.layer_spec import Presence, SpecChoice

    _fake_te_spec()
    layer_specs.resolve_layer_spec = lambda parser, spec, device: SpecChoice(spec, "test fake: the CPU spec for TE's")
    # apex's fused_weight_gradient_mlp_cuda is a CUDA kernel: faked present, and the config field it serves left off
    # (megatron's CPU layers would call the kernel); what runs is the rest of --grad-accum-fusion: megatron's DDP
    layer_specs.apex_weight_gradient_fusion = lambda: Presence(True, "test fake")
    spec_overrides = common.spec_overrides
    common.spec_overrides = lambda **options: {**spec_overrides(**options), "gradient_accumulation_fusion": False}
    from verl_fused_hook_harness.commands.e2e import thd

    seen = []  # an observer of the parity snapshots: which gradients they read, and how large

    def observed(model, **options):
        grads = snapshot(model, **options)
        seen.append({"names": len(grads), "main_grad": all(hasattr(p, "main_grad") for p in model.parameters()),
                     "abs_sum": float(sum(grad.abs().sum() for grad in grads.values()))})  # fmt: skip
        return grads

    snapshot, thd.snapshot_gradients = thd.snapshot_gradients, observed
    with cuda_names_on_cpu():  # megatron's DDP on CPU tensors, as train-parity's engines
        code = bench.main(
            [
                "--device", "cpu", "--hf-config", str(ROOT / "verl_fused_hook_harness/configs/tiny_qwen2"),
                "--modes", "legacy,hook+ours", "--sizes", "128", "--warmups", "2", "--repeats", "1",
                "--layer-spec", "te", "--grad-accum-fusion", "--out", str(out),
            ]
        )  # fmt: skip
    return code, seen


def test_grad_accum_fusion_runs_the_modes_on_megatrons_ddp(tmp_path):
    """The model in megatron's DDP: verl's build step switches the wrapped model between modes, the gradients are
    read from DDP's main_grad (zeroed between steps: the second warm-up would double them otherwise) and hook mode
    equals legacy on them."""
    code, seen = run_in_processes(_main_grad_worker, 1, tmp_path)[0]
    assert code == 0
    # legacy's and hook's parity steps: every parameter's main_grad read, the same non-zero gradients
    assert len(seen) == 2 and seen[0]["main_grad"] and seen[0]["names"] > 0 and seen[0]["abs_sum"] > 0, seen
    assert seen[0] == seen[1], seen
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert report["grad_accum_fusion"] is True and report["layer_specs"] == ["te"]
    (entry,) = report["sizes"]
    rows = {row["mode"]: row for row in entry["modes"]}
    assert rows["legacy"]["resolved"] == "legacy" and rows["hook+ours"]["resolved"] == "hook"
    parity = rows["hook+ours"]["vs_legacy"]
    assert parity["grads_max_abs"] == 0.0, parity
