"""`e2e-bench --distillation` on the CPU (timings there mean nothing): every mode goes through verl's forward_step with
distillation_ppo_loss; hook mode agrees with verl's unfused path within 1e-5 (loss, every metric, the per-token KL,
every gradient), the estimator runs inside the op in the fused-loss mode, and verl's legacy fused forward stops with
its KeyError on forward_kl_topk (an error row, the other modes still measured)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from table_titles import assert_every_table_names

from verl_fused_hook_harness.support.distributed import run_in_processes

RTOL = 1e-5
ROOT = Path(__file__).resolve().parent.parent


def _bench_worker(rank, world_size, out, loss_mode):
    from verl_fused_hook_harness.commands.e2e import bench as e2e_bench

    return e2e_bench.main(
        [
            "--distillation", loss_mode, "--topk", "16", "--device", "cpu",
            "--hf-config", str(ROOT / "verl_fused_hook_harness/configs/tiny_qwen2"),
            "--sizes", "128", "--warmups", "1", "--repeats", "1", "--out", str(out),
        ]
    )  # fmt: skip


@pytest.mark.parametrize("loss_mode", ["forward_kl_topk", "k3"])
def test_distillation_bench_agrees_with_verl_unfused_on_cpu(tmp_path, loss_mode):
    from verl_fused_hook_harness.commands.e2e.distillation import PARITY_KEY

    assert run_in_processes(_bench_worker, 1, tmp_path, loss_mode)[0] == 0
    report = json.loads((tmp_path / "e2e_distillation.json").read_text())
    assert report["distillation"]["loss_mode"] == loss_mode
    (size,) = report["sizes"]
    rows = {row["mode"]: row for row in size["modes"]}
    assert list(rows) == ["verl-unfused", "hook+ours+mask", "hook+ours+fused-loss", "legacy"]
    assert rows["verl-unfused"]["resolved"] == "unfused" and rows["hook+ours+mask"]["resolved"] == "hook"
    for mode in ("hook+ours+mask", "hook+ours+fused-loss"):
        row = rows[mode]
        assert row["train_s"] > 0 and row["train_peak_bytes"] > 0
        parity = row[PARITY_KEY]
        assert parity["loss"] == pytest.approx(parity["loss_reference"], rel=RTOL) and parity["loss_reference"] != 0
        assert "distillation/loss" in parity["metrics"]
        for key, values in parity["metrics"].items():
            assert values["value"] == pytest.approx(values["reference"], rel=RTOL, abs=1e-7), (mode, key)
        assert parity["grads_rel"] <= RTOL and parity["log_probs"] <= 1e-6
    fused_calls = rows["hook+ours+fused-loss"]["fused_loss_calls"]
    if loss_mode == "forward_kl_topk":
        assert rows["hook+ours+mask"][PARITY_KEY]["distillation_losses"] <= 1e-5
        assert {"distillation/overlap_ratio", "distillation/student_mass"} <= set(rows["hook+ours+mask"]["metrics"])
        assert fused_calls == 0  # not fused: the two-pass path
        assert rows["legacy"]["error"] == "KeyError: 'distillation_losses'"
    else:
        assert fused_calls == 2  # the parity step and the timed step, loss inside the op
        assert PARITY_KEY in rows["legacy"]  # verl's legacy forward runs the estimators
    table = (tmp_path / "e2e_distillation.md").read_text()
    assert_every_table_names(table, "cpu", 1)
    assert "| 128 (8) | hook+ours+mask | torch |" in table


def test_distillation_bench_refuses_other_flavours(capsys):
    from verl_fused_hook_harness.commands.e2e import bench as e2e_bench

    for extra in (["--fused-loss"], ["--layout", "bshd"], ["--mtp", "1"]):
        with pytest.raises(SystemExit):
            e2e_bench.main(["--distillation", "k3", "--device", "cpu", *extra])
        assert "--distillation runs on the packed layout alone" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e_bench.main(["--distillation", "k3", "--device", "cpu", "--modes", "hook+ours+mask"])
    assert "verl-unfused is the reference" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e_bench.main(["--distillation", "forward_kl", "--device", "cpu"])
    assert "invalid choice" in capsys.readouterr().err
