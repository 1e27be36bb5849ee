"""Where an engine's resolved plan lives: on the GPTModel it applies to.

Why on the model: verl hands its call sites only the model chunk
(`patch_fused_forward(model)`, `fused_forward_fn(model=...)`), never the
engine, so the plan must travel with the model, exactly as verl keeps its own
`_verl_fused_forward_mode` there. Only the engine integration reads it; the
output processor itself stays stateless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..probe import unwrap_to_gpt
from ..switch import HOOK, FusedForwardPlan

PLAN_ATTRIBUTE = "_verl_fused_hook_plan"
COUNTS_ATTRIBUTE = "_verl_fused_hook_counts"
VERL_MODE_ATTRIBUTE = "_verl_fused_forward_mode"  # verl's own record of hook vs legacy (model_forward_fused)


def set_plan(model: torch.nn.Module, plan: FusedForwardPlan | None) -> None:
    inner = unwrap_to_gpt(model)
    if plan is None:
        inner.__dict__.pop(PLAN_ATTRIBUTE, None)
    else:
        setattr(inner, PLAN_ATTRIBUTE, plan)


def plan_of(model: torch.nn.Module) -> FusedForwardPlan | None:
    return getattr(unwrap_to_gpt(model), PLAN_ATTRIBUTE, None)


def in_hook_mode(model: torch.nn.Module) -> bool:
    plan = plan_of(model)
    return plan is not None and plan.mode == HOOK


@dataclass
class HookCounts:
    """What hook mode ran on one model since it was built: engine forwards through the hook, and those whose
    loss was computed inside the op. Read-only evidence for logs and commands (e.g. train-parity)."""

    forwards: int = 0
    fused_loss_forwards: int = 0


def counts_of(model: torch.nn.Module) -> HookCounts:
    """The model's HookCounts (created on first use)."""
    inner = unwrap_to_gpt(model)
    counts = inner.__dict__.get(COUNTS_ATTRIBUTE)
    if counts is None:
        counts = HookCounts()
        setattr(inner, COUNTS_ATTRIBUTE, counts)
    return counts
