"""`verl-fused-hook train-parity` on CUDA (skipped without CUDA) at the shipped tiny Qwen2, bf16, 4 steps, on
megatron-core's local layer spec and on Transformer Engine's (where TE imports):
legacy and hook with backend verl (one kernel) identical at every step, the resumed steps identical to the
uninterrupted ones and offload on identical to off in every mode; hook with backend auto (this package's
kernel) within the tool's bounds of legacy, and with the fused loss (ppo_loss inside the op) within its
bounds of hook-auto. The full-size run (Qwen2.5-0.5B shapes, 20 steps) is the command
in docs/usage.md, not a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from layer_spec_cases import BOTH_SPECS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "verl_fused_hook_harness" / "configs" / "tiny_qwen2"
FIELDS = ("loss", "grad_norm", "param_checksum")


@pytest.mark.parametrize("layer_spec", BOTH_SPECS)
def test_train_parity_on_cuda(tmp_path, layer_spec):
    command = [
        sys.executable, "-m", "verl_fused_hook_harness.cli", "train-parity", "--device", "cuda", "--hf-config",
        str(TINY),
        "--steps", "4", "--prompts", "2", "--prompt-lengths", "3,9", "--response-lengths", "2,10",
        "--offload", "both", "--layer-spec", layer_spec, "--out", str(tmp_path),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "train_parity.json").read_text())
    runs = report["runs"]

    def values(key, first=1):
        return [tuple(row[f] for f in FIELDS) for row in runs[key] if row["step"] >= first]

    assert values("hook-verl/offload-off") == values("legacy/offload-off")
    for mode in ("legacy", "hook-verl", "hook-auto", "hook-auto-mask", "hook-auto-fused-loss"):
        assert values(f"{mode}/resumed") == values(f"{mode}/offload-off", first=3)
        assert values(f"{mode}/offload-on") == values(f"{mode}/offload-off")
    assert all(row["peak_bytes"] > 0 for row in runs["legacy/offload-off"])
    # ppo_loss inside the op on both micro-batches of every step, within the report's bounds of hook-auto
    assert all(row["fused_loss_calls"] == 2 for row in runs["hook-auto-fused-loss/offload-off"])
    assert "hook-auto-fused-loss vs hook-auto" in report["evaluation"]["gaps"]
    assert report["evaluation"]["match"] and not report["evaluation"]["pending"]
