"""Hook mode on verl's padded (BSHD) layout on CUDA (skipped without CUDA), run as users run the A/B command.

`verl-fused-hook ab-parity --layout bshd`, TP=1 on the shipped tiny Qwen2: verl as it
ships (its build step turns fused kernels off on `use_remove_padding=False`, so its
unfused BSHD forward) against hook mode (fused kernels kept on), through verl's
`forward_step`, within the script's unfused tolerance:
- backend verl (verl's kernel, every row, padding included), fp32 model: 2e-3
  (TF32 in Triton's dot);
- backend triton (this package's kernel on the rows the loss reads), bf16 model: 5e-2
  (verl's unfused logits are rounded to bf16).
Each case names its layer spec: megatron-core's local spec, and Transformer Engine's where TE imports. On TE's
spec bf16 runs; fp32 is refused at start-up by name: TE runs fp32 attention in its unfused backend only, whose
get_full_mask cannot take verl's padded mask (the H100 failed there, in the decoder, before the output layer):
Transformer Engine's limitation, verl's path and hook mode alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from layer_spec_cases import NEEDS_TE

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


def _ab_parity_bshd(tmp_path, *flags) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [*COMMAND, *flags, "--json", str(tmp_path / "ab_bshd.json")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.parametrize(
    "layer_spec, backend, dtype, rtol",
    [
        ("local", "verl", "fp32", 2e-3),
        ("local", "triton", "bf16", 5e-2),
        pytest.param("te", "triton", "bf16", 5e-2, marks=NEEDS_TE),
    ],
)
def test_hook_bshd_matches_verl_as_it_ships(tmp_path, layer_spec, backend, dtype, rtol):
    done = _ab_parity_bshd(tmp_path, "--layer-spec", layer_spec, "--backend", backend, "--dtype", dtype)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads((tmp_path / "ab_bshd.json").read_text())
    assert report["layout"] == "bshd" and report["layer_spec"] == layer_spec
    assert report["match"] and report["unfused_rtol"] == rtol
    assert [e["scenario"]["name"] for e in report["scenarios"]] == ["tp1/nosp/untied", "tp1/nosp/tied"]
    for entry in report["scenarios"]:
        assert entry["modes_resolved"] == {"legacy": "unfused", "hook": "hook"}
        assert all(entry["vs_unfused_rel"]["hook"][k] <= rtol for k in PARITY_KEYS), entry["vs_unfused_rel"]


@NEEDS_TE
def test_te_spec_in_fp32_is_refused_naming_transformer_engines_limitation(tmp_path):
    done = _ab_parity_bshd(tmp_path, "--layer-spec", "te", "--backend", "verl", "--dtype", "fp32")
    assert done.returncode == 2, done.stdout[-4000:] + done.stderr[-4000:]
    assert "--layout bshd in fp32 on Transformer Engine's layer spec: TE runs fp32 attention in its unfused" in (
        done.stderr
    )
    assert "Transformer Engine's limitation; use --dtype bf16 or --layer-spec local" in done.stderr
    assert not (tmp_path / "ab_bshd.json").exists()
