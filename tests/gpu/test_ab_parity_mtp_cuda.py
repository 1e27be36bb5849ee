"""`verl-fused-hook ab-parity --mtp-layers 1` on CUDA (skipped without CUDA): hook mode's fused MTP loss (this
package's Triton kernel, bf16) against verl's own MTP path (fused kernels off), TP=1 on the shipped tiny Qwen2, on
megatron-core's local layer spec and on Transformer Engine's (where TE imports).

At one rank the command runs both sides in one worker process (commands/ab/mtp.py), so the run pays
Python's imports and CUDA/NCCL start-up twice (this command, its worker), not three times; on the CPU the
same command takes ~20 s, nearly all of it start-up. The command prints per-phase timings; a run past
TIME_LIMIT_S fails with them instead of eating the device call.
"""

from __future__ import annotations

import json
import os
import signal
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
TIME_LIMIT_S = 150


@pytest.mark.parametrize("layer_spec", BOTH_SPECS)
def test_fused_mtp_loss_matches_verls_mtp_path_on_cuda(tmp_path, layer_spec):
    out = tmp_path / "ab_mtp.json"
    command = [
        sys.executable,
        "-m",
        "verl_fused_hook_harness.cli",
        "ab-parity",
        "--device",
        "cuda",
        "--tp",
        "1",
        "--backend",
        "triton",
        "--dtype",
        "bf16",
        "--mtp-layers",
        "1",
        "--layer-spec",
        layer_spec,
        "--json",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # its own process group: on a timeout the command and its worker are killed together (a worker left
    # holding the output pipe would keep the test waiting)
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as process:
        try:
            printed, _ = process.communicate(timeout=TIME_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            printed, _ = process.communicate()
            pytest.fail(f"ab-parity --mtp-layers 1 ran past {TIME_LIMIT_S}s; what it printed:\n{printed[-4000:]}")
    print(printed[-3000:])  # the per-phase timings, for the log
    assert process.returncode == 0, printed[-6000:]
    assert f"layer spec: {layer_spec} (" in printed
    report = json.loads(out.read_text())
    assert report["match"] and [e["scenario"] for e in report["scenarios"]] == ["tp1/nosp/untied", "tp1/nosp/tied"]
    for entry in report["scenarios"]:
        assert entry["fused"] == {"verl": False, "hook": True}
        assert entry["mtp"]["mtp_loss"] <= report["rtol"]
        assert all(entry["vs_verl_rel"][k] <= report["rtol"] for k in ("log_probs", "entropy", "policy_loss", "grads"))
