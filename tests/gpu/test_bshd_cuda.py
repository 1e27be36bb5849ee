"""Hook mode on verl's padded (BSHD) layout on CUDA (skipped without CUDA), run as users run the A/B command.

`verl-fused-hook ab-parity --layout bshd`, TP=1 on the shipped tiny Qwen2: verl as it
ships (its build step turns fused kernels off on `use_remove_padding=False`, so its
unfused BSHD forward) against hook mode (fused kernels kept on), through verl's
`forward_step`, within the script's unfused tolerance:
- backend verl (verl's kernel, every row, padding included), fp32 model: 2e-3
  (TF32 in Triton's dot);
- backend triton (this package's kernel on the rows the loss reads), bf16 model: 5e-2
  (verl's unfused logits are rounded to bf16).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]
COMMAND = [
    sys.executable,
    "-m",
    "verl_fused_hook_harness.cli",
    "ab-parity",
    "--device",
    "cuda",
    "--tp",
    "1",
    "--layout",
    "bshd",
]
PARITY_KEYS = ("log_probs", "entropy", "policy_loss", "grads")


@pytest.mark.parametrize("backend, dtype, rtol", [("verl", "fp32", 2e-3), ("triton", "bf16", 5e-2)])
def test_hook_bshd_matches_verl_as_it_ships(tmp_path, backend, dtype, rtol):
    out = tmp_path / "ab_bshd.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [*COMMAND, "--backend", backend, "--dtype", dtype, "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["layout"] == "bshd" and report["match"] and report["unfused_rtol"] == rtol
    assert [e["scenario"]["name"] for e in report["scenarios"]] == ["tp1/nosp/untied", "tp1/nosp/tied"]
    for entry in report["scenarios"]:
        assert entry["modes_resolved"] == {"legacy": "unfused", "hook": "hook"}
        assert all(entry["vs_unfused_rel"]["hook"][k] <= rtol for k in PARITY_KEYS), entry["vs_unfused_rel"]
