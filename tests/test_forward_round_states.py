"""scripts/forward_round_states.py's host timing on the CPU (its rounds need CUDA): the functions it times run
unchanged while timed and are put back after."""

import importlib.util
from pathlib import Path

import torch

from verl_fused_hook.ops import log_probs_and_entropy, two_pass
from verl_fused_hook.ops.backends import triton_backend

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "forward_round_states.py"


def test_timed_functions_compute_the_same_values_and_are_restored():
    spec = importlib.util.spec_from_file_location("forward_round_states", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(40, 32, generator=g), torch.randn(300, 32, generator=g)
    labels = torch.randint(0, 300, (40,), generator=g)
    before = log_probs_and_entropy(hidden, weight, labels, temperature=0.7)
    originals = {name: getattr(two_pass, name) for name in script.HOST_FUNCTIONS["two_pass"]}
    spent = {}
    with script.timing_functions({"two_pass": two_pass, "triton_backend": triton_backend}, spent):
        timed = log_probs_and_entropy(hidden, weight, labels, temperature=0.7)
    assert all(torch.equal(a, b) for a, b in zip(before, timed))
    assert len(spent["two_pass.build_problem"]) == 1 and spent["two_pass.build_problem"][0] > 0
    assert {name: getattr(two_pass, name) for name in originals} == originals
