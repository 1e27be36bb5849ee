"""`e2e-bench` on an MoE model, on the CPU (timings there mean nothing): the tiny Qwen3-MoE config builds and runs
every THD mode (megatron-core's MoE layer through the stand-ins of stand_ins/moe_cpu.py), hook mode identical to
legacy on the portable op; `--moe`'s shipped Qwen3-30B-A3B-shaped config converts, through mbridge, to the shapes
the GPU run is meant to measure (too large to build in a test: 1.8B parameters)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_fused_hook_harness.support.distributed import run_in_processes

ROOT = Path(__file__).resolve().parent.parent
TINY_MOE = ROOT / "verl_fused_hook_harness/configs/tiny_qwen3_moe"


def _worker(rank, world_size, out):
    from mbridge import AutoBridge

    from verl_fused_hook_harness.commands.e2e import bench as e2e_bench
    from verl_fused_hook_harness.support.hf_model import QWEN3_30B_A3B_2LAYER, load_hf_config, local_spec_overrides

    status = e2e_bench.main([
        "--device", "cpu", "--hf-config", str(TINY_MOE), "--modes", "legacy,hook+ours,hook+ours+mask",
        "--sizes", "128", "--warmups", "1", "--repeats", "1", "--out", str(out),
    ])  # fmt: skip
    hf_config = load_hf_config(QWEN3_30B_A3B_2LAYER)
    bridge = AutoBridge.from_config(hf_config)
    bridge.set_extra_args(**local_spec_overrides(hf_config))
    config = bridge.config
    shapes = {key: getattr(config, key) for key in ("hidden_size", "num_layers", "num_moe_experts", "moe_router_topk",
                                                    "moe_ffn_hidden_size", "moe_grouped_gemm")}  # fmt: skip
    return status, shapes | {"vocab_size": hf_config.vocab_size}


def test_moe_model_runs_every_mode_and_the_moe_config_has_qwen3_30b_a3b_shapes(tmp_path):
    ((status, shapes),) = run_in_processes(_worker, 1, tmp_path)
    assert status == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    (size,) = report["sizes"]
    rows = {row["mode"]: row for row in size["modes"]}
    assert set(rows) == {"legacy", "hook+ours", "hook+ours+mask"}
    for mode in ("hook+ours", "hook+ours+mask"):
        parity = rows[mode]["vs_legacy"]
        assert parity["log_probs"] == parity["entropy"] == parity["policy_loss"] == parity["grads_max_abs"] == 0.0
        assert parity["worst_param"] is None  # every gradient identical, the experts' and router's included
    assert shapes == {
        "hidden_size": 2048,
        "num_layers": 2,
        "num_moe_experts": 128,
        "moe_router_topk": 8,
        "moe_ffn_hidden_size": 768,
        "moe_grouped_gemm": False,
        "vocab_size": 151936,
    }


def test_moe_option_takes_no_other_config(capsys):
    from verl_fused_hook_harness.commands.e2e import bench as e2e_bench

    with pytest.raises(SystemExit):
        e2e_bench.main(["--device", "cpu", "--moe", "--hf-config", str(TINY_MOE)])
    assert "--moe: the MoE model is the shipped Qwen3-30B-A3B-shaped config" in capsys.readouterr().err
