"""`verl-fused-hook train-parity --pp 2` and `--ep 2` on the CPU: GRPO steps through verl's engine under pipeline
parallelism (2 gloo processes, megatron's 1F1B schedule) and expert parallelism (an MoE model, 2 processes that are
2 data-parallel ranks), with a checkpoint after step 1 resumed in fresh processes.

On the CPU every mode computes with the portable op, so legacy and hook-auto must train identically bit for bit
(loss, gradient norm, a checksum of every parameter on every rank), the fused loss too, the resumed step must
repeat the uninterrupted one, and the fused-loss mode must run ppo_loss inside the op on every micro-batch (under
PP: on the last stage, whose rank reports the step's loss)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "verl_fused_hook_harness.cli", "train-parity"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
MODES = ("legacy", "hook-auto", "hook-auto-fused-loss")
FIELDS = ("loss", "grad_norm", "param_checksum")
MOE = str(ROOT / "verl_fused_hook_harness" / "configs" / "tiny_qwen3_moe")


@pytest.mark.parametrize("layout", (("--pp", "2"), ("--ep", "2", "--hf-config", MOE)), ids=("pp2", "ep2"))
def test_modes_train_identically_and_resume_exactly(layout, tmp_path):
    command = [*COMMAND, "--device", "cpu", *layout, "--steps", "2", "--modes", ",".join(MODES), "--offload", "off",
               "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "train_parity.json").read_text())
    assert report["configuration"][layout[0][2:]] == 2
    runs = report["runs"]
    values = {key: [tuple(row[f] for f in FIELDS) for row in rows] for key, rows in runs.items()}
    legacy = values["legacy/offload-off"]
    assert all(loss is not None and grad_norm > 0 for loss, grad_norm, _ in legacy)
    assert len({checksum for *_, checksum in legacy}) == 2  # the parameters changed every step
    for mode in MODES:
        assert values[f"{mode}/offload-off"] == legacy, f"{mode} trains differently from legacy"
        assert values[f"{mode}/resumed"] == legacy[1:], f"{mode}: the resumed step differs"
    micro_batches = 2  # the CPU default: 2 prompts x 5 responses in micro-batches of 5
    for key in ("offload-off", "resumed"):
        assert [row["fused_loss_calls"] for row in runs[f"hook-auto-fused-loss/{key}"]] == [micro_batches] * len(
            runs[f"hook-auto-fused-loss/{key}"]
        )
    assert report["evaluation"]["match"] and not report["evaluation"]["pending"]
    assert done.stdout.rstrip().endswith("PASS")


def test_ep_needs_an_moe_config(capsys):
    from verl_fused_hook_harness.commands.train import parity as train_parity

    with pytest.raises(SystemExit):
        train_parity.main(["--device", "cpu", "--ep", "2"])
    assert "--ep 2: needs an MoE --hf-config whose experts divide by it (this one has 0)" in capsys.readouterr().err
