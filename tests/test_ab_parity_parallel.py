"""`verl-fused-hook ab-parity --pp/--vpp/--ep/--moe-experts`, run as users run it (CPU, gloo).

One run (PP=2 x VPP=2, MoE with 4 experts: 2 processes) through verl's train_batch: hook and legacy identical
(one kernel), both within the unfused tolerance of verl's unfused path, which equals the unsplit model within
1e-5. The flag combinations it refuses are checked without starting processes. Expert parallelism itself runs
in tests/test_moe.py (the same support/parallel_engine.py code, EP=2 and EP=2 x TP=2).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "verl_fused_hook_harness.cli", "ab-parity"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run_script(*args, timeout=900):
    return subprocess.run([*COMMAND, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_vpp_moe_run_passes(tmp_path):
    path = tmp_path / "ab.json"
    done = run_script("--device", "cpu", "--pp", "2", "--vpp", "2", "--moe-experts", "4", "--json", str(path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(path.read_text())
    case = report["case"]
    assert (case["world"], case["pp"], case["vpp"], case["experts"], case["layers"]) == (2, 2, 2, 4, 4)
    rows = report["comparisons"]
    assert report["match"] and report["one_kernel"]
    assert all(value == 0.0 for value in rows["hook vs legacy"]["worst"].values())
    for label, bound in (("hook vs unfused", 1e-4), ("legacy vs unfused", 1e-4), ("unfused vs unsplit model", 1e-5)):
        assert rows[label]["match"] and all(value <= bound for value in rows[label]["worst"].values()), label
    assert rows["hook vs unfused"]["worst"]["grads"] > 0  # gradients were compared, not absent
    assert "\nPASS\n" in done.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (("--vpp", "2"), "--vpp: model chunks per stage (>= 2), with --pp >= 2"),
        (("--pp", "2", "--vpp", "1"), "--vpp: model chunks per stage (>= 2), with --pp >= 2"),
        (("--ep", "2"), "--ep: expert parallelism needs an MoE model"),
        (("--ep", "2", "--moe-experts", "3"), "--moe-experts: expected 0 (dense) or a multiple of --ep (2), got 3"),
        (("--pp", "2", "--layout", "bshd"), "compare on the packed layout without MTP"),
        (("--pp", "2", "--dtype", "bf16"), "--pp/--vpp/--ep/--moe-experts run in fp32"),
        (
            ("--pp", "4", "--vpp", "2", "--hf-config", "verl_fused_hook_harness/configs/tiny_qwen2"),
            "the model's 2 layers do not split into 8 chunks",
        ),
    ],
)
def test_refused_flag_combinations(args, message, capsys):
    """argparse errors (exit 2) naming the flag, before any process starts."""
    from verl_fused_hook_harness.commands.ab import parity as ab_parity

    with pytest.raises(SystemExit) as stopped:
        ab_parity.main(["--device", "cpu", *args])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err
