"""The A/B parity command (`verl-fused-hook ab-parity`), run as users run it: legacy (VERL_FUSED_USE_OP_HOOK=0) vs
hook (=1), TP=1 and TP=2 on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "verl_fused_hook_harness.cli", "ab-parity"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
ALL_SCENARIOS = {
    "tp1/nosp/untied",
    "tp1/nosp/tied",
    "tp2/nosp/untied",
    "tp2/nosp/tied",
    "tp2/sp/untied",
    "tp2/sp/tied",
}


def run_script(*args, timeout=900):
    command = [*COMMAND, *args]
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One full default run (every scenario, both modes), as CI runs it: (report, stdout, stderr)."""
    path = tmp_path_factory.mktemp("ab") / "ab.json"
    done = run_script("--device", "cpu", "--json", str(path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(path.read_text()), done.stdout, done.stderr


@pytest.fixture(scope="module")
def cpu_report(cpu_run):
    return cpu_run[:2]


def test_every_scenario_is_bit_identical(cpu_report):
    report, stdout = cpu_report
    assert report["match"] is True and report["device"] == "cpu" and report["backend"] == "torch"
    assert {entry["scenario"]["name"] for entry in report["scenarios"]} == ALL_SCENARIOS
    for entry in report["scenarios"]:
        assert entry["modes_resolved"] == {"legacy": "legacy", "hook": "hook"}, entry["scenario"]
        for tensor in ("log_probs", "entropy", "policy_loss", "grads"):
            assert entry["max_abs"][tensor] == 0.0, (entry["scenario"]["name"], tensor)
    assert "PASS: hook and legacy identical (max_abs = 0) and within 0.0001 of verl's unfused forward" in stdout
    assert "the legacy forward's kernel was swapped" in stdout
    assert "[legacy] 6 scenario(s) done in " in stdout and "[hook] 6 scenario(s) done in " in stdout


def test_the_demo_prints_its_result_not_the_noise(cpu_run):
    """The default run fits on one screen: upstream warnings and log lines are summarised in one line."""
    _, stdout, stderr = cpu_run
    printed = (stdout + stderr).splitlines()
    assert len(printed) <= 40, "\n".join(printed)
    (summary,) = [line for line in printed if line.startswith("upstream notices: ")]
    assert "megatron GPTModel deprecation x" in summary and "Apex/TE fallbacks x" in summary
    assert summary.endswith("; --verbose shows them")
    assert "GPTModel IS DEPRECATED" not in stdout + stderr and "warnings.warn(" not in stderr
    assert any(line.startswith("PASS: hook and legacy identical") for line in printed)


def test_verbose_shows_the_upstream_notices_and_every_scenario(tmp_path):
    done = run_script("--device", "cpu", "--scenarios", "tp1/nosp/untied", "--verbose")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "GPTModel IS DEPRECATED" in done.stderr and "Apex is not installed" in done.stderr
    assert "[legacy] tp1/nosp/untied done in " in done.stdout and "[hook] tp1/nosp/untied done in " in done.stdout
    assert "upstream notices: " not in done.stdout + done.stderr
    assert "PASS: hook and legacy identical" in done.stdout


def test_hook_matches_verl_unfused_forward_everywhere(cpu_report):
    report, _ = cpu_report
    assert report["unfused_rtol"] == 1e-4
    for entry in report["scenarios"]:
        hook = entry["vs_unfused_rel"]["hook"]
        for tensor in ("log_probs", "entropy", "policy_loss", "grads"):
            assert hook[tensor] <= 1e-4, (entry["scenario"]["name"], tensor, hook[tensor])


def test_tp_gap_is_reported_and_is_the_only_difference(cpu_report):
    report, _ = cpu_report
    gaps = [
        entry
        for entry in report["scenarios"]
        if entry["scenario"]["tp"] == 2 and not entry["scenario"]["sequence_parallel"]
    ]
    assert len(gaps) == 2
    for entry in gaps:
        assert entry["compared_against"] == "legacy+tp-sum"
        shipped = entry["vs_legacy_expected_gap"]
        assert shipped["log_probs"] == shipped["entropy"] == shipped["policy_loss"] == 0.0
        assert shipped["grads"] > 1e-3  # verl's legacy forward misses the TP sum of the hidden gradient
        legacy_truth = entry["vs_unfused_rel"]["legacy"]
        assert legacy_truth["log_probs"] <= 1e-4 and legacy_truth["grads"] > 1e-2  # legacy's gradient is the wrong one


def test_peak_memory_is_reported_per_mode(cpu_report):
    report, stdout = cpu_report
    for entry in report["scenarios"]:
        peaks = entry["peak_bytes"]
        assert peaks["legacy"] > 0 and peaks["hook"] > 0
        assert peaks["hook"] == peaks["legacy"]  # one kernel, one set of tensors
    assert "peak legacy" in stdout and "peak hook" in stdout


def _script_module():
    from verl_fused_hook_harness.commands.ab import parity as ab_parity

    return ab_parity


def _scenarios_module():
    from verl_fused_hook_harness.commands.ab import scenarios as ab_scenarios

    return ab_scenarios


@pytest.mark.parametrize(
    "args, message",
    [
        (["--scenarios", "tp3/sp/tied"], "--scenarios: unknown ['tp3/sp/tied']"),
        (["--device", "cpu", "--backend", "verl"], "--backend verl needs CUDA"),
        (["--device", "cpu", "--backend", "triton"], "--backend triton needs CUDA"),
        (["--device", "cpu", "--backend", "triton", "--dtype", "fp32"], "--backend triton takes bf16"),
        (["--device", "cpu", "--backend", "fast"], "--backend 'fast': allowed auto, "),
        (["--hf-config", "/nonexistent/config.json"], "--hf-config: /nonexistent/config.json does not exist"),
    ],
)
def test_bad_arguments_are_refused_before_any_work(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _script_module().main(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_compare_reports_the_worst_parameter():
    ab = _scenarios_module()
    same = {"log_probs": torch.zeros(3), "entropy": torch.ones(3), "policy_loss": torch.zeros(1)}
    legacy = [{"s": {**same, "grads": {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([5.0, 0.0])}}}]
    hook = [{"s": {**same, "grads": {"a": torch.tensor([1.0, 2.25]), "b": torch.tensor([5.5, 0.0])}}}]
    rows = ab.compare_runs(legacy, "s", hook, "s")
    assert rows == {"log_probs": 0.0, "entropy": 0.0, "policy_loss": 0.0, "grads": 0.5, "worst_param": "b"}
    relative = ab.compare_runs(legacy, "s", hook, "s", relative=True)
    assert relative["grads"] == 0.125 and relative["worst_param"] == "a"  # 0.25/2 beats 0.5/5
    assert ab.compare_runs(legacy, "s", legacy, "s")["worst_param"] is None
    hook[0]["s"]["grads"] = {"a": torch.zeros(2)}
    assert ab.compare_runs(legacy, "s", hook, "s")["grads"] == float("inf")


def _synthetic_runs(value_error: float, grad_error: float, rerun_grad_error: float):
    """Legacy (with a rerun and its unfused reference) and hook results for one scenario, errors as given."""
    base = {
        "log_probs": torch.full((4,), -3.0),
        "entropy": torch.full((4,), 2.0),
        "policy_loss": torch.ones(1),
        "grads": {"w": torch.full((3,), 2.0)},
        "mode": None,
        "peak_bytes": 1,
    }

    def shifted(dv, dg):
        return {
            **base,
            "log_probs": base["log_probs"] + dv,
            "entropy": base["entropy"] + dv,
            "policy_loss": base["policy_loss"] + dv,
            "grads": {"w": base["grads"]["w"] + dg},
        }

    name = "tp1/nosp/untied"
    legacy = {name: {**base, "mode": "legacy"}, f"{name}:legacy-rerun": shifted(0.0, rerun_grad_error)}
    hook = {name: {**shifted(value_error, grad_error), "mode": "hook"}, f"{name}:verl-unfused": base}
    return {"legacy": [legacy], "hook": [hook]}


@pytest.mark.parametrize(
    "one_kernel, value_error, grad_error, rerun_error, match",
    [
        (True, 0.0, 0.0, 0.0, True),
        (True, 0.0, 1e-6, 0.0, False),  # one kernel: any gradient difference is a mismatch
        (False, 5e-5, 0.02, 0.0, True),  # two kernels: 5e-5 <= 1e-4 on values, 0.02/2 = 1e-2 <= 2e-2 relative
        (False, 2e-4, 0.0, 0.0, False),  # values past 1e-4
        (False, 0.0, 0.1, 0.0, False),  # gradients past 2e-2 relative (0.05)
        (True, 0.0, 0.0, 1e-6, False),  # a rerun that differs: the run is not repeatable, nothing is proven
    ],
)
def test_evaluate_holds_one_kernel_to_zero_and_two_kernels_to_their_accuracy(
    one_kernel, value_error, grad_error, rerun_error, match
):
    from verl_fused_hook_harness.commands.ab import thd as ab_thd

    runs = _synthetic_runs(value_error, grad_error, rerun_error)
    entry = ab_thd.evaluate(ab_thd.Scenario(1, False, False), runs, one_kernel=one_kernel, rtol=1.0)
    assert entry["match"] is match
    assert ("rel" in entry) is (not one_kernel)


def test_four_ranks_on_gloo(tmp_path):
    """TP=4 (four gloo processes a mode) on a model whose 4 KV heads split over the ranks."""
    path = tmp_path / "ab_tp4.json"
    config = ROOT / "verl_fused_hook_harness" / "configs" / "tiny_qwen2_kv4"
    done = run_script("--device", "cpu", "--tp", "4", "--hf-config", str(config), "--json", str(path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(path.read_text())
    assert {entry["scenario"]["name"] for entry in report["scenarios"]} == {"tp4/nosp/untied", "tp4/sp/tied"}
    for entry in report["scenarios"]:
        for tensor in ("log_probs", "entropy", "policy_loss", "grads"):
            assert entry["max_abs"][tensor] == 0.0, (entry["scenario"]["name"], tensor)
    assert "(4 processes per mode)" in done.stdout
