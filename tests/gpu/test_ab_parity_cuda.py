"""`verl-fused-hook ab-parity` on CUDA (skipped without CUDA), run as users run it, TP=1 on the shipped tiny Qwen2,
on megatron-core's local layer spec and on Transformer Engine's (where TE imports).

- backend verl (legacy's own kernel on the hook side): max_abs = 0 on log-probs, entropy, loss and every
  gradient, and the legacy rerun identical (the run is deterministic, so the zero means something);
- backend triton (bf16): this package's kernel against verl's, within the kernels' accuracy.
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
COMMAND = [sys.executable, "-m", "verl_fused_hook_harness.cli", "ab-parity"]
PARITY_KEYS = ("log_probs", "entropy", "policy_loss", "grads")


def _run(tmp_path, *extra):
    out = tmp_path / "ab.json"
    command = [*COMMAND, "--device", "cuda", "--tp", "1", "--json", str(out), *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("layer_spec", BOTH_SPECS)
def test_one_kernel_is_bit_identical(tmp_path, layer_spec):
    report = _run(tmp_path, "--backend", "verl", "--layer-spec", layer_spec)
    assert report["layer_spec"] == layer_spec
    assert report["one_kernel"] and report["match"]
    assert [e["scenario"]["name"] for e in report["scenarios"]] == ["tp1/nosp/untied", "tp1/nosp/tied"]
    for entry in report["scenarios"]:
        assert entry["modes_resolved"] == {"legacy": "legacy", "hook": "hook"}
        assert all(entry["max_abs"][k] == 0.0 for k in PARITY_KEYS), entry["max_abs"]
        assert all(entry["legacy_rerun"][k] == 0.0 for k in PARITY_KEYS), entry["legacy_rerun"]


@pytest.mark.parametrize("layer_spec", BOTH_SPECS)
def test_our_triton_kernel_within_kernel_accuracy(tmp_path, layer_spec):
    report = _run(tmp_path, "--backend", "triton", "--dtype", "bf16", "--layer-spec", layer_spec)
    assert report["layer_spec"] == layer_spec
    assert not report["one_kernel"] and report["match"] and report["dtype"] == "bf16"
    for entry in report["scenarios"]:
        assert all(entry["max_abs"][k] <= 1e-4 for k in ("log_probs", "entropy", "policy_loss")), entry["max_abs"]
        assert entry["rel"]["grads"] <= 2e-2, entry["rel"]
        assert all(entry["legacy_rerun"][k] == 0.0 for k in PARITY_KEYS), entry["legacy_rerun"]
