"""`e2e-bench` options on the CPU (timings there mean nothing): `--layers` and `--recompute` reach the built model
(its config's fields, as the report records them) and a run with both completes, hook mode still identical to
legacy on the portable op."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_fused_hook_harness.support.distributed import run_on_gloo

ROOT = Path(__file__).resolve().parent.parent


def _bench_worker(rank, world_size, out, *extra):
    from verl_fused_hook_harness.commands import e2e_bench

    return e2e_bench.main([
        "--device", "cpu", "--hf-config", str(ROOT / "verl_fused_hook_harness/configs/tiny_qwen2"),
        "--modes", "legacy,hook+ours", "--sizes", "128", "--warmups", "1", "--repeats", "1", "--out", str(out), *extra,
    ])


def test_layers_and_recompute_reach_the_model_and_the_run_completes(tmp_path):
    assert run_on_gloo(_bench_worker, 1, tmp_path, "--layers", "3", "--recompute")[0] == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert report["model"] == {  # the tiny config has 2 layers and no recompute
        "num_layers": 3, "recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1,
    }
    (size,) = report["sizes"]
    rows = {row["mode"]: row for row in size["modes"]}
    assert all(row["train_s"] > 0 and row["train_peak_bytes"] > 0 for row in rows.values())
    parity = rows["hook+ours"]["vs_legacy"]
    assert parity["log_probs"] == parity["entropy"] == parity["policy_loss"] == parity["grads_max_abs"] == 0.0


def test_without_the_options_the_config_decides_and_profiles_and_spreads_are_written(tmp_path):
    assert run_on_gloo(_bench_worker, 1, tmp_path, "--repeats", "2", "--profile", str(tmp_path / "profile"))[0] == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert report["model"] == {"num_layers": 2, "recompute_granularity": None, "recompute_method": None,
                               "recompute_num_layers": None}
    for row in report["sizes"][0]["modes"]:  # every repeat kept: the noise is stated, not only the median
        assert len(row["train_times_s"]) == len(row["forward_times_s"]) == 2
        text = (tmp_path / "profile" / f"profile_128_{row['mode']}.txt").read_text()
        assert f"# {row['mode']}: by device time" in text and f"# {row['mode']}: by host time" in text
        assert "aten::mm" in text  # the profiler's operator table, not an empty file
        no_grad = (tmp_path / "profile" / f"profile_128_{row['mode']}_no_grad.txt").read_text()
        assert f"# {row['mode']}: by device time" in no_grad and "aten::mm" in no_grad
        assert "backward" not in no_grad.lower()  # the forward alone
    assert " ±" in (tmp_path / "e2e.md").read_text()


def test_layers_must_be_positive(capsys):
    from verl_fused_hook_harness.commands import e2e_bench

    with pytest.raises(SystemExit):
        e2e_bench.main(["--device", "cpu", "--layers", "0"])
    assert "--layers: expected >= 1, got 0" in capsys.readouterr().err


def test_timed_repeats_run_in_rounds_over_the_modes():
    """A drift in the machine's speed must not favour the mode timed first: repeats go A, B, A, B, ..."""
    import torch

    from verl_fused_hook_harness.commands.e2e_bench import time_in_rounds
    from verl_fused_hook_harness.commands.e2e_setup import Clock
    from verl_fused_hook_harness.support.modes import Mode

    calls = []

    class RecordingStep:  # stands in for e2e_thd.Step: records which mode ran and whether gradients were on
        def __init__(self, name):
            self.name = name

        def train(self):
            calls.append((self.name, "train", torch.is_grad_enabled()))

        def forward(self):
            calls.append((self.name, "forward", torch.is_grad_enabled()))

    modes = [Mode("a", hook=False, kernel="verl"), Mode("b", hook=True, kernel="ours")]
    primed = [(mode, RecordingStep(mode.name), {"mode": mode.name}) for mode in modes]
    enabled = []
    time_in_rounds(primed, torch.nn.Linear(1, 1), {"a": "engine a", "b": "engine b"},
                   lambda model, engine, mode: enabled.append(engine), Clock("cpu"), 3, 128)
    assert calls == [("a", "train", True), ("b", "train", True)] * 3 + [("a", "forward", False), ("b", "forward", False)] * 3
    assert enabled == ["engine a", "engine b"] * 6  # each timed step runs in its own mode
    for _, _, row in primed:
        assert len(row["train_times_s"]) == len(row["forward_times_s"]) == 3
        assert row["train_s"] >= 0 and row["forward_peak_bytes"] >= 0
