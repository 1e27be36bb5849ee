"""megatron-core's `output_processor` hook: per-token log-probs and entropy instead of logits.

`GPTModel.forward(..., output_processor=fused_output_processor,
output_processor_context=FusedOutputProcessorContext(temperature=...))` returns
log-probs and entropy of `labels` straight from the final hidden states, so the
[tokens, vocab] logits and their gradient never exist. The processor is
stateless: everything per-forward travels in the context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

from .ops import BACKEND_CHOICES, log_probs_and_entropy
from .ops.loss_inside import log_probs_entropy_and_loss
from .ops.interface import check_temperature_values

# "verl" runs verl's own Triton kernel exactly as verl's forward does (bit-identical A/B runs).
PROCESSOR_BACKENDS: tuple[str, ...] = (*BACKEND_CHOICES, "verl")


def _check_temperature_field(temperature) -> None:
    if isinstance(temperature, torch.Tensor) and (not temperature.is_floating_point() or temperature.dim() > 2):
        raise ValueError(
            "FusedOutputProcessorContext.temperature: a tensor must be floating point and 0-d, [b] or [b, s], "
            f"got {temperature.dtype} {tuple(temperature.shape)}"
        )
    check_temperature_values("FusedOutputProcessorContext.temperature", temperature)


@dataclass(frozen=True)
class FusedOutputProcessorContext:
    """Per-forward options of `fused_output_processor` (passed as `output_processor_context=`).

    temperature: float > 0, or a tensor: 0-d, per sample [b], or per token [b, s].
    calculate_entropy: compute the entropy too (False returns entropy None).
    score_mask: bool [b, s]; False positions are never multiplied by the output
        weight (prompt, padding) and get log-prob 0, entropy 0.
    backend: the op backend ("auto", "torch", GPU kernels), or "verl" for verl's
        own Triton kernel (scalar temperature, no score_mask/vocab_size).
    tile_rows: rows per tile (None: the op's default).
    vocab_size: the true vocabulary; padded columns past it leave the softmax.
    as_tuple: return `(log_probs, entropy)` tensors instead of an output object
        (the combined-1F1B schedule plan only carries tensors).
    loss_fn: a token-separable loss of the [s, b] log-probs and entropy -> (loss, metrics),
        computed inside the op (`log_probs_entropy_and_loss`); the output's `loss` then
        back-propagates into the model and `loss_metrics` holds the metrics.
    loss_name: names loss_fn in errors.
    row_gradients: optional per-row gradients of loss_fn (see `log_probs_entropy_and_loss`).
    host_loss_fn: optional, loss_fn over host tensors, for the final evaluation (see
        `log_probs_entropy_and_loss`).
    loss_chunk_bytes: the fused loss's chunk of stored logits in bytes (None: the op's default;
        tile_rows, when given, wins).
    """

    temperature: float | torch.Tensor = 1.0
    calculate_entropy: bool = True
    score_mask: torch.Tensor | None = field(default=None, repr=False)
    backend: str = "auto"
    tile_rows: int | None = None
    vocab_size: int | None = None
    as_tuple: bool = False
    loss_fn: Callable[..., tuple[torch.Tensor, Any]] | None = field(default=None, repr=False)
    loss_name: str = "loss"
    row_gradients: Callable | None = field(default=None, repr=False)
    host_loss_fn: Callable[..., tuple[torch.Tensor, Any]] | None = field(default=None, repr=False)
    loss_chunk_bytes: int | None = None

    def __post_init__(self):
        for name in ("row_gradients", "host_loss_fn", "loss_chunk_bytes"):
            if getattr(self, name) is not None and self.loss_fn is None:
                raise ValueError(f"FusedOutputProcessorContext.{name}: belongs to a fused loss; set loss_fn too")
        if self.loss_fn is not None and (self.backend == "verl" or self.as_tuple):
            raise ValueError(
                "FusedOutputProcessorContext.loss_fn: needs the op (backend in "
                f"{', '.join(BACKEND_CHOICES)}) and an output object (as_tuple=False)"
            )
        _check_temperature_field(self.temperature)
        if not isinstance(self.calculate_entropy, bool):
            raise ValueError(f"FusedOutputProcessorContext.calculate_entropy: expected a bool, got {self.calculate_entropy!r}")
        if not isinstance(self.as_tuple, bool):
            raise ValueError(f"FusedOutputProcessorContext.as_tuple: expected a bool, got {self.as_tuple!r}")
        if self.score_mask is not None and (
            not isinstance(self.score_mask, torch.Tensor)
            or self.score_mask.dtype != torch.bool
            or self.score_mask.dim() != 2
            or self.score_mask.device.type == "meta"
        ):
            raise ValueError(
                "FusedOutputProcessorContext.score_mask: expected None or a bool tensor [b, s] shaped like labels "
                "(not on the meta device)"
            )
        if self.backend not in PROCESSOR_BACKENDS:
            raise ValueError(
                f"FusedOutputProcessorContext.backend: unknown {self.backend!r}; allowed: {', '.join(PROCESSOR_BACKENDS)}"
            )
        if self.tile_rows is not None and (
            isinstance(self.tile_rows, bool) or not isinstance(self.tile_rows, int) or self.tile_rows < 1
        ):
            raise ValueError(f"FusedOutputProcessorContext.tile_rows: expected None or an int >= 1, got {self.tile_rows!r}")
        if self.loss_chunk_bytes is not None and (
            isinstance(self.loss_chunk_bytes, bool) or not isinstance(self.loss_chunk_bytes, int) or self.loss_chunk_bytes < 1
        ):
            raise ValueError(
                f"FusedOutputProcessorContext.loss_chunk_bytes: expected None or an int >= 1, got {self.loss_chunk_bytes!r}"
            )
        if self.vocab_size is not None and (
            isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int) or self.vocab_size < 1
        ):
            raise ValueError(f"FusedOutputProcessorContext.vocab_size: expected None or an int >= 1, got {self.vocab_size!r}")
        if self.backend == "verl":
            unsupported = [
                name
                for name, used in (
                    ("score_mask", self.score_mask is not None),
                    ("vocab_size", self.vocab_size is not None),
                    ("temperature", isinstance(self.temperature, torch.Tensor) and self.temperature.dim() > 0),
                    ("calculate_entropy", not self.calculate_entropy),
                )
                if used
            ]
            if unsupported:
                raise ValueError(
                    f"FusedOutputProcessorContext.{unsupported[0]}: not supported with backend='verl' "
                    f"(verl's kernel takes a scalar temperature over every row and column); "
                    f"use backend in {', '.join(BACKEND_CHOICES)}"
                )


@dataclass
class LogProbsOutput:
    """Stand-in for verl's CausalLMOutputForPPO when verl is not installed (same fields)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    past_key_values: object = None
    hidden_states: torch.Tensor | None = None
    attentions: object = None
    loss_metrics: Any = None  # the metrics of a fused loss (context.loss_fn)


def _make_output(log_probs: torch.Tensor, entropy: torch.Tensor | None, hidden_states: torch.Tensor):
    try:
        from verl.utils.model import CausalLMOutputForPPO
    except ImportError:
        return LogProbsOutput(log_probs=log_probs, entropy=entropy, hidden_states=hidden_states)
    output = CausalLMOutputForPPO(loss=None, logits=None, past_key_values=None, hidden_states=hidden_states, attentions=None)
    output.log_probs = log_probs
    output.entropy = entropy
    return output


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


def logit_multiplier(scale_logits, config) -> float:
    """The factor Megatron's `_scale_logits` (MuP) applies to logits, checked to be a plain scale."""
    if scale_logits is None or not getattr(config, "use_mup", False):
        return 1.0
    probe = scale_logits(torch.tensor([1.0, 2.0], dtype=torch.float64))
    factor = float(probe[0])
    if not (math.isfinite(factor) and factor > 0 and float(probe[1]) == 2.0 * factor):
        raise ValueError(
            f"scale_logits: fused_output_processor supports a positive constant logit scale (MuP), got {probe.tolist()} for [1, 2]"
        )
    return factor


def _tp_group_of(output_layer):
    group = getattr(output_layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
    return group


def _per_token(value: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Broadcast a [b] or [b, s] temperature tensor to labels' [b, s]."""
    if value.shape not in (labels.shape[:1], labels.shape):
        raise ValueError(
            f"FusedOutputProcessorContext.temperature: a tensor must be 0-d, [b] = {tuple(labels.shape[:1])} "
            f"or [b, s] = {tuple(labels.shape)} like labels, got {tuple(value.shape)}"
        )
    if value.dim() == 1:
        value = value.unsqueeze(1)
    return value.to(labels.device).expand(labels.shape)


def _transposed(values: torch.Tensor | None) -> torch.Tensor | None:
    return values.t().contiguous() if values is not None else None


def _check_output_layer_has_no_bias(output_layer) -> None:
    """The processor computes hidden @ weight.T; a bias it silently dropped would change every log-prob."""
    if getattr(output_layer, "bias", None) is not None:
        raise ValueError(
            f"output_layer ({type(output_layer).__name__}) has a bias; fused_output_processor supports only a "
            "bias-free output layer (megatron-core's GPTModel builds it without one)"
        )


def fused_output_processor(
    *,
    hidden_states: torch.Tensor,
    output_layer: torch.nn.Module,
    output_weight: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    context: FusedOutputProcessorContext | None = None,
    config=None,
    scale_logits=None,
    **_later_arguments,
):
    """`GPTModel.forward(output_processor=...)` callback: log-probs and entropy of `labels`, [b, s] fp32.

    hidden_states arrive [s, b, h] (sequence-sharded under sequence parallelism);
    labels are [b, s]. With tensor parallelism the hidden-state gradient is summed
    over the group: by the sequence-parallel gather's reduce-scatter, or, without
    sequence parallelism, by an explicit all-reduce, exactly as Megatron's output
    layer does in the default path. Returns verl's CausalLMOutputForPPO (or
    LogProbsOutput without verl), or a `(log_probs, entropy)` tuple when
    `context.as_tuple`.
    """
    context = context if context is not None else FusedOutputProcessorContext()
    if not isinstance(context, FusedOutputProcessorContext):
        raise ValueError(
            f"output_processor_context: expected a FusedOutputProcessorContext, got {type(context).__name__}"
        )
    if labels is None:
        raise ValueError("labels: fused_output_processor computes log-probs of the labels, so GPTModel.forward needs labels=")
    _check_output_layer_has_no_bias(output_layer)
    weight = resolve_output_weight(output_layer, output_weight)
    tp_group = _tp_group_of(output_layer)
    tp_size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    hidden = hidden_states
    if tp_size > 1:
        if getattr(output_layer, "sequence_parallel", False):
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=tp_group)
        else:
            hidden = copy_to_tensor_model_parallel_region(hidden, group=tp_group)
    if hidden.shape[:2] != labels.shape[::-1]:
        raise ValueError(
            f"labels: expected [b, s] = {tuple(hidden.shape[1::-1])} to match hidden states [s, b, h] "
            f"{tuple(hidden.shape)}, got {tuple(labels.shape)}"
        )

    if context.score_mask is not None and context.score_mask.shape != labels.shape:
        raise ValueError(
            f"FusedOutputProcessorContext.score_mask: must be shaped like labels [b, s] = {tuple(labels.shape)}, "
            f"got {tuple(context.score_mask.shape)}"
        )
    temperature = context.temperature
    multiplier = logit_multiplier(scale_logits, config)
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        temperature = (_per_token(temperature, labels).float() / multiplier).t()
    else:
        temperature = float(temperature) / multiplier
    labels_sb = labels.t()
    # what both ops take alike, in the [s, b] layout of the hidden states
    problem = dict(
        temperature=temperature,
        tp_group=tp_group if tp_size > 1 else None,
        score_mask=None if context.score_mask is None else context.score_mask.to(labels.device).t(),
        vocab_size=context.vocab_size,
        calculate_entropy=context.calculate_entropy,
    )

    if context.backend == "verl":
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        log_probs, entropy = linear_cross_entropy(
            hidden, weight, labels_sb.contiguous(), temperature, "none", tp_group if tp_size > 1 else None
        )
        log_probs, entropy = log_probs.view(labels_sb.shape), entropy.view(labels_sb.shape)
    elif context.loss_fn is not None:
        fused = log_probs_entropy_and_loss(
            hidden,
            weight,
            labels_sb,
            **problem,
            loss_fn=context.loss_fn,
            loss_name=context.loss_name,
            chunk_rows=context.tile_rows,
            row_gradients=context.row_gradients,
            host_loss_fn=context.host_loss_fn,
            chunk_bytes=context.loss_chunk_bytes,
        )
        output = _make_output(fused.log_probs.t().contiguous(), _transposed(fused.entropy), hidden_states)
        output.loss, output.loss_metrics = fused.loss, fused.metrics
        return output
    else:
        log_probs, entropy = log_probs_and_entropy(
            hidden, weight, labels_sb, **problem, backend=context.backend, tile_rows=context.tile_rows
        )
    log_probs = log_probs.t().contiguous()
    entropy = _transposed(entropy)
    if context.as_tuple:
        return (log_probs, entropy) if entropy is not None else (log_probs,)
    return _make_output(log_probs, entropy, hidden_states)
