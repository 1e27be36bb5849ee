"""`verl-fused-hook ab-parity --mtp-layers 1` on CUDA (skipped without CUDA): hook mode's fused MTP loss (this
package's Triton kernel, bf16) against verl's own MTP path (fused kernels off), TP=1 on the shipped tiny Qwen2."""

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


def test_fused_mtp_loss_matches_verls_mtp_path_on_cuda(tmp_path):
    out = tmp_path / "ab_mtp.json"
    command = [sys.executable, "-m", "verl_fused_hook.cli", "ab-parity", "--device", "cuda", "--tp", "1",
               "--backend", "triton", "--dtype", "bf16", "--mtp-layers", "1", "--json", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["match"] and [e["scenario"] for e in report["scenarios"]] == ["tp1/nosp/untied", "tp1/nosp/tied"]
    for entry in report["scenarios"]:
        assert entry["fused"] == {"verl": False, "hook": True}
