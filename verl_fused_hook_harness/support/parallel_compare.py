"""How the parallel-layout runs (support/parallel_engine.py) are judged: two sides' results on one rank.

Why a list of named differences rather than asserts: the same check must pass
for hook mode against verl's unfused path, and must fail, naming what broke,
when a test injects a fault into a stage hand-off (tests/test_pipeline_parallel.py).
"""

from __future__ import annotations

import torch

RTOL = 1e-5  # fp32: relative to the reference's largest magnitude (per loss, metric, tensor, parameter)
ABS_FLOOR = 1e-7  # for values that are 0 in the reference


def _close(want: float, got: float, rtol: float) -> bool:
    return abs(got - want) <= rtol * max(abs(want), ABS_FLOOR / rtol)


def _tensor_error(want: torch.Tensor, got: torch.Tensor) -> float:
    """max |got - want| over the reference's max magnitude (inf when the shapes differ)."""
    if want.shape != got.shape:
        return float("inf")
    if want.numel() == 0:
        return 0.0
    difference = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    return difference / scale if scale > 0 else difference / ABS_FLOOR * RTOL


def _flatten(value) -> list[float]:
    if isinstance(value, (list, tuple)):
        return [x for item in value for x in _flatten(item)]
    return [float(value)]


def differences(want: dict, got: dict, *, rtol: float = RTOL, gradients_of_got_only: bool = False) -> list[str]:
    """What differs between two results of `run_side` on one rank beyond `rtol` (empty: they agree).

    gradients_of_got_only: `got` holds a part of `want`'s parameters (a pipeline stage or an expert shard of
    the reference's unsplit model): compare those. Losses and metrics are compared where `got` has them (the
    last pipeline stage)."""
    found = []
    if got["losses"]:
        if len(got["losses"]) != len(want["losses"]):
            found.append(f"losses: {len(got['losses'])} micro-batches vs {len(want['losses'])}")
        else:
            for index, (w, g) in enumerate(zip(want["losses"], got["losses"])):
                if not _close(w, g, rtol):
                    found.append(f"loss of micro-batch {index}: {g!r} vs {w!r}")
    if got["metrics"]:
        if set(got["metrics"]) != set(want["metrics"]):
            found.append(f"metric keys: {sorted(set(got['metrics']) ^ set(want['metrics']))} on one side only")
        for key in sorted(set(got["metrics"]) & set(want["metrics"])):
            w, g = _flatten(want["metrics"][key]), _flatten(got["metrics"][key])
            if len(w) != len(g) or not all(_close(a, b, rtol) for a, b in zip(w, g)):
                found.append(f"metric {key}: {got['metrics'][key]!r} vs {want['metrics'][key]!r}")
    for key in ("log_probs", "entropy"):
        if key in got and _tensor_error(want[key], got[key]) > rtol:
            found.append(f"{key}: relative error {_tensor_error(want[key], got[key]):.3g}")
    names = set(got["grads"]) if gradients_of_got_only else set(got["grads"]) | set(want["grads"])
    missing = sorted(names - set(want["grads"]) | names - set(got["grads"]))
    if missing:
        found.append(f"gradients held by one side only: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for name in sorted(names - set(missing)):
        error = _tensor_error(want["grads"][name], got["grads"][name])
        if error > rtol:
            found.append(f"gradient of {name}: relative error {error:.3g}")
    return found


def worst_errors(want: dict, got: dict, *, gradients_of_got_only: bool = False) -> dict[str, float]:
    """The largest relative error per quantity between two results on one rank (what the reports print):
    losses, metrics, log_probs, entropy, grads; 0.0 where `got` holds none (a non-last pipeline stage)."""
    worst = {"losses": 0.0, "metrics": 0.0, "log_probs": 0.0, "entropy": 0.0, "grads": 0.0}

    def scalar(w: float, g: float) -> float:
        return abs(g - w) / max(abs(w), ABS_FLOOR)

    if got["losses"]:
        worst["losses"] = max(scalar(w, g) for w, g in zip(want["losses"], got["losses"]))
    for key in set(got["metrics"]) & set(want["metrics"]):
        pairs = zip(_flatten(want["metrics"][key]), _flatten(got["metrics"][key]))
        worst["metrics"] = max([worst["metrics"], *(scalar(w, g) for w, g in pairs)])
    for key in ("log_probs", "entropy"):
        if key in got:
            worst[key] = _tensor_error(want[key], got[key])
    names = set(got["grads"]) if gradients_of_got_only else set(got["grads"]) | set(want["grads"])
    for name in names:
        if name not in want["grads"] or name not in got["grads"]:
            worst["grads"] = float("inf")
        else:
            worst["grads"] = max(worst["grads"], _tensor_error(want["grads"][name], got["grads"][name]))
    return worst
