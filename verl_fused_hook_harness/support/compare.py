"""How the commands compare two runs: the largest difference of a tensor, absolute or relative, and the worst
parameter gradient. One definition, so a max_abs of 0 (or a relative 1e-7) means the same in every report.
"""

from __future__ import annotations

import torch

# The per-token outputs and the loss every parity report compares (gradients are compared per parameter).
VALUES = ("log_probs", "entropy", "policy_loss")


def max_abs(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Largest absolute difference in float64, on `other`'s device (a reference may be kept on the CPU); inf when
    the shapes differ, 0 for empty tensors."""
    if reference.shape != other.shape:
        return float("inf")
    reference = reference.to(other.device)
    return (reference.double() - other.double()).abs().max().item() if reference.numel() else 0.0


def error(reference: torch.Tensor, other: torch.Tensor, *, relative: bool = False) -> float:
    """max_abs, or (relative) max_abs over the reference's largest magnitude (max_abs itself where that is 0);
    computed on `other`'s device."""
    reference = reference.to(other.device)
    difference = max_abs(reference, other)
    if not relative or difference in (0.0, float("inf")):
        return difference
    scale = reference.double().abs().max().item()
    return difference / scale if scale > 0 else difference


def relative_scalar(reference: float, value: float) -> float:
    """|value - reference| / |reference| (the absolute difference where the reference is 0)."""
    return abs(value - reference) / abs(reference) if reference != 0 else abs(value)


def worst_gradient(reference: dict, other: dict, *, relative: bool = False) -> tuple[float, str | None]:
    """The largest `error` over the parameters of `reference` (all must be in `other`) and that parameter's
    name; (0.0, None) when every gradient is identical."""
    worst, worst_name = 0.0, None
    for name, gradient in reference.items():
        value = error(gradient, other[name], relative=relative)
        if value > worst:
            worst, worst_name = value, name
    return worst, worst_name


def differing_parameters(reference: dict, other: dict) -> list[str]:
    """Parameter names held by one side only (a run that trained other parameters cannot be compared)."""
    return sorted(reference.keys() ^ other.keys())
