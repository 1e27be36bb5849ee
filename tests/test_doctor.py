"""`verl-fused-hook doctor` on the CPU: every check's line, and a non-zero exit for what would fail at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OLD_MEGATRON = Path(__file__).resolve().parent / "old_megatron"  # test-only fake: GPTModel.forward without the hook


def doctor(*args: str, env: dict | None = None, pythonpath: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "VERL_FUSED_USE_OP_HOOK"}
    environ["PYTHONPATH"] = os.pathsep.join(map(str, (*pythonpath, ROOT)))
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "verl_fused_hook_harness.cli", "doctor", *args],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=600,
    )


def lines(done: subprocess.CompletedProcess) -> dict[str, str]:
    """topic -> "status text", of the check lines."""
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("[") and line[5:7] == "] ":  # "[stat] topic (padded to 14) text"
            found[line[7:21].strip()] = f"{line[1:5].strip()} {line[22:]}"
    return found


def test_doctor_passes_on_a_supported_cpu_machine():
    done = doctor("--hidden-size", "3584", env={"VERL_FUSED_USE_OP_HOOK": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    checks = lines(done)
    assert checks["megatron-core"].startswith("ok 0.19.2 (>= 0.18)")
    assert checks["verl"].startswith("ok 0.9.1")
    assert checks["hook probe"].startswith("ok") and "log-probs match its logits" in checks["hook probe"]
    assert (
        "auto picks torch for bfloat16 H=3584 on cpu; triton: CUDA is not available; torch: runs; verl: "
        in checks["backends"]
    )
    assert "verl_fused_hook = verl_fused_hook.verl_integration.plugin imports" in checks["entry point"]
    assert "uses the output_processor hook, backend=auto (VERL_FUSED_USE_OP_HOOK=1)" in checks["plan"]
    assert checks["op self-check"].startswith("ok cpu float32 300x256x5003")
    assert checks["invariance"] == (
        "ok cpu float32, backend torch: 77 rows alone and among 5 and 1000 others (first, last, others masked): "
        "the same bits"
    )
    assert done.stdout.rstrip().endswith("doctor: OK (12 checks, 0 warnings)")
    assert len(done.stdout.splitlines()) == 13  # the checks and the verdict: upstream notices are summarised
    assert "upstream notices:" in done.stderr and "--verbose shows them" in done.stderr


def test_doctor_fails_when_megatron_core_lacks_the_hook():
    done = doctor(pythonpath=(OLD_MEGATRON,))
    assert done.returncode == 1, done.stdout + done.stderr
    probe = lines(done)["hook probe"]
    assert probe.startswith("FAIL GPTModel.forward has no output_processor / output_processor_context parameter")
    assert "needs megatron-core>=0.18.0" in probe
    assert "doctor: FAIL: hook probe" in done.stdout


def test_doctor_fails_on_a_bad_switch_and_on_a_misspelt_entry():
    done = doctor(env={"VERL_FUSED_USE_OP_HOOK": "yes"})
    assert done.returncode == 1
    assert lines(done)["plan"].startswith("FAIL ValueError: VERL_FUSED_USE_OP_HOOK='yes' is not allowed; use 1")
    done = doctor(
        "+actor_rollout_ref.model.fused_kernel_options.output_processor_fused_los=true",
        env={"VERL_FUSED_USE_OP_HOOK": "1"},
    )
    assert done.returncode == 1
    plan = lines(done)["plan"]
    assert "output_processor_fused_los is not a verl_fused_hook entry; did you mean " in plan
    assert plan.endswith(
        "output_processor_fused_loss_chunk_gib, output_processor_score_mask, output_processor_keep_logits_gib"
    )


def test_doctor_resolves_the_plan_from_hydra_overrides():
    done = doctor(
        "+actor_rollout_ref.model.fused_kernel_options.use_output_processor_hook=true",
        "+actor_rollout_ref.model.fused_kernel_options.output_processor_fused_loss=true",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    plan = lines(done)["plan"]
    assert "the environment and actor_rollout_ref.model.fused_kernel_options of the composed config" in plan
    assert (
        "backend=auto (actor_rollout_ref.model.fused_kernel_options.use_output_processor_hook=true), "
        "output_processor_fused_loss=true" in plan
    )
