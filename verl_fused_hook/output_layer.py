"""What the output layer tells the processor and the MTP loss: its weight, its logit scale, and how its rows
are spread over tensor-parallel ranks.

Why one module: the hook (`fused_output_processor`) and the MTP loss (`fused_process_mtp_loss`) both stand
in for megatron's `ColumnParallelLinear` output layer, and must read it the same way: the vocab-parallel
weight (tied or not), a bias they refuse rather than drop, MuP's logit multiplier, and whether its input is
sequence-sharded (sequence parallelism) or replicated over the TP group, which the op's `tp_hidden` then
turns into megatron's gather / all-reduce of the hidden-state gradient.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .log_once import log_once

logger = logging.getLogger(__name__)


def resolve_output_weight(output_layer, output_weight) -> torch.Tensor:
    """The vocab-parallel output weight: the shared embedding when tied, else the output layer's own."""
    if output_weight is not None:
        return output_weight
    weight = getattr(output_layer, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2:
        raise ValueError(
            f"output_layer ({type(output_layer).__name__}): no plain [V_local, H] weight Parameter to project with "
            "(got output_weight=None and output_layer.weight="
            f"{type(weight).__name__}); fused_output_processor needs the logits to be hidden @ weight.T, "
            "so adapters on the output layer (e.g. LoRA) are not supported"
        )
    return weight


def adds_weight_grad_to_main_grad(output_layer, weight: torch.Tensor, backend: str) -> bool:
    """What megatron's output layer would do with its weight gradient, for the op's gradient_accumulation_fusion:
    with its `gradient_accumulation_fusion` (megatron's config field, copied onto the layer) and a `main_grad` on
    the weight (DDP-wrapped), add it into main_grad; otherwise return it, as megatron's layer also does for a
    weight without main_grad (a model not wrapped in DDP) or a Megatron-FSDP one (its own hook makes main_grad,
    and may overwrite it rather than add). Backend "verl" returns it too (its kernel computes d_weight itself), for
    every call of the step alike: a placeholder from one call beside a real gradient from another would make DDP
    drop the real one. Each reason is said once in the log."""
    if not getattr(output_layer, "gradient_accumulation_fusion", False):
        return False
    if backend == "verl":
        reason = "backend 'verl' computes it in its own kernel"
    elif getattr(weight, "__fsdp_param__", False):
        reason = "its weight is a Megatron-FSDP parameter, whose own gradient hook makes main_grad"
    elif not hasattr(weight, "main_grad"):
        reason = (
            "its weight has no main_grad (not wrapped in megatron's DistributedDataParallel), as megatron's layer does"
        )
    else:
        return True
    if weight.requires_grad and torch.is_grad_enabled():
        log_once(
            logger,
            f"{type(output_layer).__name__} has gradient_accumulation_fusion, but the output layer's "
            f"d_weight is returned: {reason}",
            key=reason,
            every_rank=True,
        )
    return False


def check_output_layer_has_no_bias(output_layer) -> None:
    """The processor computes hidden @ weight.T; a bias it silently dropped would change every log-prob."""
    if getattr(output_layer, "bias", None) is not None:
        raise ValueError(
            f"output_layer ({type(output_layer).__name__}) has a bias; fused_output_processor supports only a "
            "bias-free output layer (megatron-core's GPTModel builds it without one)"
        )


def logit_multiplier(scale_logits, config) -> float:
    """The factor Megatron's `_scale_logits` (MuP) applies to logits, checked to be a plain scale."""
    if scale_logits is None or not getattr(config, "use_mup", False):
        return 1.0
    probe = scale_logits(torch.tensor([1.0, 2.0], dtype=torch.float64))
    factor = float(probe[0])
    if not (math.isfinite(factor) and factor > 0 and float(probe[1]) == 2.0 * factor):
        raise ValueError(
            f"scale_logits: fused_output_processor supports a positive constant logit scale (MuP), got "
            f"{probe.tolist()} for [1, 2]"
        )
    return factor


@dataclass(frozen=True)
class TensorParallelLayout:
    """group: the TP group the vocabulary is split over (None with one rank); tp_hidden: the op's layout of the
    hidden rows ("sequence_sharded" under sequence parallelism, else "replicated")."""

    group: dist.ProcessGroup | None
    size: int
    tp_hidden: str


def tensor_parallel_layout(output_layer, tp_group=None) -> TensorParallelLayout:
    """How `output_layer`'s input is spread over TP ranks; `tp_group` overrides the layer's own group."""
    group = tp_group if tp_group is not None else getattr(output_layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    size = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    sequence_parallel = size > 1 and bool(getattr(output_layer, "sequence_parallel", False))
    return TensorParallelLayout(
        group=group if size > 1 else None,
        size=size,
        tp_hidden="sequence_sharded" if sequence_parallel else "replicated",
    )
