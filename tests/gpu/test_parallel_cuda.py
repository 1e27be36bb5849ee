"""Pipeline and expert parallelism on GPUs (needs 2 CUDA devices; skipped otherwise), NCCL, one GPU a rank.

- megatron-core's p2p facts behind the VPP refusal (tests/test_pipeline_p2p.py) on NCCL: at PP=2 the shape
  exchange hands each rank the peer's gradient shape as recv_prev, and batched p2p swaps the tensors;
- `verl-fused-hook ab-parity --device cuda` with --pp 2, with --pp 2 --vpp 2 --moe-experts 8, and with --ep 2
  --moe-experts 8 (fp32, backend verl: verl's Triton kernel on both sides): hook and legacy identical (dense; MoE
  within the unfused tolerance: megatron's unpermutation adds with atomics), both within the unfused tolerance of
  verl's unfused path, which agrees with the unsplit model.
Run: python -m pytest -q tests/gpu/test_parallel_cuda.py  (on a 2-GPU machine)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_pipeline_p2p import BACKWARD_ROWS, FORWARD_ROWS, HIDDEN, p2p_worker

from verl_fused_hook_harness.support.distributed import run_in_processes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]

ROOT = Path(__file__).resolve().parents[2]
# the local spec, named: the parallel comparison draws each layer's weights inside the local-spec build (ab-parity
# refuses --layer-spec te with --pp/--vpp/--ep/--moe-experts)
COMMAND = [sys.executable, "-m", "verl_fused_hook_harness.cli", "ab-parity", "--device", "cuda"]
COMMAND += ["--layer-spec", "local"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_p2p_order_at_pp2_on_nccl():
    observed = run_in_processes(p2p_worker, 2, "cuda", backend="nccl")
    for rank, peer in ((0, 1), (1, 0)):
        assert observed[rank]["shapes"] == ([BACKWARD_ROWS[peer], 1, HIDDEN], [FORWARD_ROWS[peer], 1, HIDDEN])
        assert observed[rank]["batched=False"] == (10.0 + peer, 20.0 + peer)
        assert observed[rank]["batched=True"] == (20.0 + peer, 10.0 + peer)
        assert observed[rank]["refusal"].startswith("verl_fused_hook: virtual pipeline parallelism")


@pytest.mark.parametrize(
    "flags",
    (("--pp", "2"), ("--pp", "2", "--vpp", "2", "--moe-experts", "8"), ("--ep", "2", "--moe-experts", "8")),
    ids=("pp2", "vpp2_moe", "ep2_moe"),
)
def test_ab_parity_parallel_on_cuda(flags, tmp_path):
    path = tmp_path / "ab.json"
    done = subprocess.run([*COMMAND, *flags, "--json", str(path)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(path.read_text())
    assert report["match"] and report["one_kernel"]
    if "--moe-experts" not in flags:  # dense steps run bitwise repeatable; MoE's unpermutation uses atomics
        assert all(value == 0.0 for value in report["comparisons"]["hook vs legacy"]["worst"].values())
