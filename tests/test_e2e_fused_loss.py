"""`e2e-bench --fused-loss` on the CPU (timings there mean nothing): both modes go through verl's forward_step
with ppo_loss, the fused mode really runs ppo_loss inside the op (the plugin's count), and loss, every metric verl
reports and
every parameter gradient agree with the two-pass path within fp32 tolerance (1e-5 relative)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from table_titles import assert_every_table_names

from verl_fused_hook_harness.support.distributed import run_in_processes

RTOL = 1e-5
ROOT = Path(__file__).resolve().parent.parent


def _bench_worker(rank, world_size, out, policy_loss="vanilla"):
    """The benchmark in a fresh process."""
    from verl_fused_hook_harness.commands.e2e import bench as e2e_bench

    return e2e_bench.main(
        [
            "--fused-loss",
            "--device",
            "cpu",
            "--hf-config",
            str(ROOT / "verl_fused_hook_harness/configs/tiny_qwen2"),
            "--modes",
            "hook+ours+mask,hook+ours+fused-loss",
            "--sizes",
            "128",
            "--warmups",
            "1",
            "--repeats",
            "1",
            "--out",
            str(out),
            "--policy-loss",
            policy_loss,
        ]
    )


def test_fused_loss_bench_agrees_with_the_two_pass_path_on_cpu(tmp_path):
    from verl_fused_hook_harness.commands.e2e.fused_loss import PARITY_KEY

    assert run_in_processes(_bench_worker, 1, tmp_path)[0] == 0
    report = json.loads((tmp_path / "e2e_fused_loss.json").read_text())
    (size,) = report["sizes"]
    rows = {row["mode"]: row for row in size["modes"]}
    assert list(rows) == ["hook+ours+mask", "hook+ours+fused-loss"]
    # the plugin's own count: ppo_loss ran inside the op on the parity step and the timed step, in the fused mode only
    assert rows["hook+ours+fused-loss"]["fused_loss_calls"] == 2 and rows["hook+ours+mask"]["fused_loss_calls"] == 0
    assert all(
        row["resolved"] == "hook" and row["train_s"] > 0 and row["train_peak_bytes"] > 0 for row in rows.values()
    )
    parity = rows["hook+ours+fused-loss"][PARITY_KEY]
    assert parity["loss"] == pytest.approx(parity["loss_reference"], rel=RTOL) and parity["loss_reference"] != 0
    # what ppo_loss reports with the entropy bonus and the KL loss: all present, all equal
    assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy_loss", "kl_loss"} <= set(
        parity["metrics"]
    )
    for key, values in parity["metrics"].items():
        assert values["value"] == pytest.approx(values["reference"], rel=RTOL, abs=1e-7), key
    assert parity["metrics"]["actor/pg_clipfrac"]["reference"] > 0  # the clip is exercised
    assert parity["grads_rel"] <= RTOL and parity["log_probs"] <= 1e-6
    table = (tmp_path / "e2e_fused_loss.md").read_text()
    assert_every_table_names(table, "cpu", 1)
    assert "| 128 (8) | hook+ours+fused-loss | torch |" in table and "reference" in table


def test_fused_loss_bench_refuses_other_layouts(capsys):
    from verl_fused_hook_harness.commands.e2e import bench as e2e_bench

    with pytest.raises(SystemExit):
        e2e_bench.main(["--fused-loss", "--device", "cpu", "--layout", "bshd"])
    assert "--fused-loss" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e_bench.main(["--fused-loss", "--device", "cpu", "--modes", "hook+ours+fused-loss"])
    assert "hook+ours+mask is the reference" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        e2e_bench.main(["--fused-loss", "--device", "cpu", "--modes", "hook+ours+mask,hook+verl"])
    assert "allowed with --fused-loss: hook+ours+mask, hook+ours+fused-loss, legacy" in capsys.readouterr().err


@pytest.mark.parametrize("policy_loss", ["gspo", "sft"])
def test_fused_loss_bench_runs_gspo_and_sft_steps_on_cpu(tmp_path, policy_loss):
    from verl_fused_hook_harness.commands.e2e.fused_loss import PARITY_KEY

    assert run_in_processes(_bench_worker, 1, tmp_path, policy_loss)[0] == 0
    report = json.loads((tmp_path / "e2e_fused_loss.json").read_text())
    assert report["actor_config"] == ({"loss": "sft_loss"} if policy_loss == "sft" else report["actor_config"])
    assert policy_loss == "sft" or report["actor_config"]["loss_mode"] == "gspo"
    rows = {row["mode"]: row for row in report["sizes"][0]["modes"]}
    assert rows["hook+ours+fused-loss"]["fused_loss_calls"] == 2 and rows["hook+ours+mask"]["fused_loss_calls"] == 0
    parity = rows["hook+ours+fused-loss"][PARITY_KEY]
    assert parity["loss"] == pytest.approx(parity["loss_reference"], rel=RTOL) and parity["loss_reference"] != 0
    assert parity["grads_rel"] <= RTOL
    assert (parity["entropy"] is None) == (policy_loss == "sft")
