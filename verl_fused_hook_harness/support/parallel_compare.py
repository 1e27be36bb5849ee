"""How the parallel-layout runs (support/parallel_engine.py) are measured against each other: two sides'
results on one rank, the worst relative error per quantity (ab-parity's table, commands/ab/parallel.py).

The tests' pass/fail list of named differences (tests/parallel_cases.py) is built on the same measures.
"""

from __future__ import annotations

import torch

RTOL = 1e-5  # fp32: relative to the reference's largest magnitude (per loss, metric, tensor, parameter)
ABS_FLOOR = 1e-7  # for values that are 0 in the reference


def tensor_error(want: torch.Tensor, got: torch.Tensor) -> float:
    """max |got - want| over the reference's max magnitude (inf when the shapes differ)."""
    if want.shape != got.shape:
        return float("inf")
    if want.numel() == 0:
        return 0.0
    difference = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    return difference / scale if scale > 0 else difference / ABS_FLOOR * RTOL


def flatten(value) -> list[float]:
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in flatten(item)]
    return [float(value)]


def worst_errors(want: dict, got: dict, *, gradients_of_got_only: bool = False) -> dict[str, float]:
    """The largest relative error per quantity between two results on one rank (what the reports print):
    losses, metrics, log_probs, entropy, grads; 0.0 where `got` holds none (a non-last pipeline stage)."""
    worst = {"losses": 0.0, "metrics": 0.0, "log_probs": 0.0, "entropy": 0.0, "grads": 0.0}

    def scalar(w: float, g: float) -> float:
        return abs(g - w) / max(abs(w), ABS_FLOOR)

    if got["losses"]:
        worst["losses"] = max(scalar(w, g) for w, g in zip(want["losses"], got["losses"]))
    for key in set(got["metrics"]) & set(want["metrics"]):
        pairs = zip(flatten(want["metrics"][key]), flatten(got["metrics"][key]))
        worst["metrics"] = max([worst["metrics"], *(scalar(w, g) for w, g in pairs)])
    for key in ("log_probs", "entropy"):
        if key in got:
            worst[key] = tensor_error(want[key], got[key])
    names = set(got["grads"]) if gradients_of_got_only else set(got["grads"]) | set(want["grads"])
    for name in names:
        if name not in want["grads"] or name not in got["grads"]:
            worst["grads"] = float("inf")
        else:
            worst["grads"] = max(worst["grads"], tensor_error(want["grads"][name], got["grads"][name]))
    return worst
