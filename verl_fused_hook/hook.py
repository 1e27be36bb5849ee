"""megatron-core's `output_processor` hook: per-token log-probs and entropy instead of logits.

`GPTModel.forward(..., output_processor=fused_output_processor,
output_processor_context=FusedOutputProcessorContext(temperature=...))` returns
log-probs and entropy of `labels` straight from the final hidden states, so the
[tokens, vocab] logits and their gradient never exist. The processor is
stateless: everything per-forward travels in the context (context.py); how the
output layer's rows are spread over tensor-parallel ranks is read from the
layer (output_layer.py) and handed to the op, which does megatron's collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .context import FusedOutputProcessorContext
from .ops import log_probs_and_entropy, log_probs_entropy_and_loss, replayed_log_probs, token_log_probs
from .output_layer import (
    adds_weight_grad_to_main_grad,
    check_output_layer_has_no_bias,
    logit_multiplier,
    resolve_output_weight,
    tensor_parallel_layout,
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
    # what context.token_ids / top_k / calculate_sum_pi_squared ask for ([b, s, ...])
    token_log_probs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_log_probs: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    # what context.replay adds: each row's kept set [b, s, k] (-1 padding), its full-vocabulary mass when computed
    kept_ids: torch.Tensor | None = None
    kept_mass: torch.Tensor | None = None


def _make_output(log_probs: torch.Tensor | None, entropy: torch.Tensor | None, hidden_states: torch.Tensor):
    try:
        from verl.utils.model import CausalLMOutputForPPO
    except ImportError:
        return LogProbsOutput(log_probs=log_probs, entropy=entropy, hidden_states=hidden_states)
    output = CausalLMOutputForPPO(
        loss=None, logits=None, past_key_values=None, hidden_states=hidden_states, attentions=None
    )
    output.log_probs = log_probs
    output.entropy = entropy
    return output


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
    """[s, b, ...] <-> [b, s, ...]"""
    return values.transpose(0, 1).contiguous() if values is not None else None


def _token_outputs(hidden_states, weight, labels_sb, labels, context: FusedOutputProcessorContext, problem: dict):
    """The op `token_log_probs` for what the context asks (ids' log-probs, top-k, sum pi^2), outputs [b, s, ...]."""
    token_ids = context.token_ids
    if token_ids is not None and token_ids.shape[:2] != labels.shape:
        raise ValueError(
            f"FusedOutputProcessorContext.token_ids: must be shaped like labels [b, s] = {tuple(labels.shape)} plus "
            f"a last dim of ids, got {tuple(token_ids.shape)}"
        )
    out = token_log_probs(
        hidden_states,
        weight,
        labels_sb,
        _transposed(None if token_ids is None else token_ids.to(labels.device)),
        **problem,
        calculate_log_probs=context.calculate_log_probs,
        top_k=context.top_k,
        calculate_sum_pi_squared=context.calculate_sum_pi_squared,
        tile_rows=context.tile_rows,
    )
    output = _make_output(_transposed(out.log_probs), _transposed(out.entropy), hidden_states)
    output.token_log_probs = _transposed(out.token_log_probs)
    output.top_ids = _transposed(out.top_ids)
    output.top_log_probs = _transposed(out.top_log_probs)
    output.sum_pi_squared = _transposed(out.sum_pi_squared)
    return output


def _replayed_outputs(hidden_states, weight, labels_sb, labels, context: FusedOutputProcessorContext, problem: dict):
    """The op `replayed_log_probs` for context.replay: log-probs, entropy (and token_ids') over each row's kept set."""
    replay = context.replay
    given = replay.kept_ids
    if given is not None and given.shape[:2] != labels.shape:
        raise ValueError(
            f"SamplingReplay.kept_ids: must be shaped like labels [b, s] = {tuple(labels.shape)} plus a last dim of "
            f"ids, got {tuple(given.shape)}"
        )
    token_ids = context.token_ids
    out = replayed_log_probs(
        hidden_states,
        weight,
        labels_sb,
        kept_ids=_transposed(None if given is None else given.to(labels.device)),
        top_k=-1 if given is not None else replay.top_k,
        top_p=1.0 if given is not None else replay.top_p,
        max_kept=replay.max_kept,
        token_ids=_transposed(None if token_ids is None else token_ids.to(labels.device)),
        chunk_rows=context.tile_rows,
        **problem,
    )
    output = _make_output(_transposed(out.log_probs), _transposed(out.entropy), hidden_states)
    output.token_log_probs = _transposed(out.token_log_probs)
    output.kept_ids = _transposed(out.kept_ids)
    output.kept_mass = _transposed(out.kept_mass)
    return output


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
    labels are [b, s]. With tensor parallelism the op sums the hidden-state gradient
    over the group exactly as Megatron's output layer does in the default path:
    reduce-scatter under sequence parallelism, all-reduce without (`tp_hidden`).
    With the output layer's `gradient_accumulation_fusion` (megatron's config field) and a DDP-wrapped weight,
    d_weight goes into the weight's `main_grad`, as megatron's layer would put it (ops/weight_gradient.py).
    With `context.token_ids`, `top_k` or `calculate_sum_pi_squared` the op is `token_log_probs`, and the output
    also carries `token_log_probs`, `top_ids`, `top_log_probs`, `sum_pi_squared` ([b, s, ...], None when not asked).
    With `context.replay` the op is `replayed_log_probs` (sampling replay): log-probs and entropy over each row's kept
    set, and the output also carries `kept_ids` and `kept_mass`.
    Returns verl's CausalLMOutputForPPO (or LogProbsOutput without verl), or a
    `(log_probs, entropy)` tuple when `context.as_tuple`.
    """
    context = context if context is not None else FusedOutputProcessorContext()
    if not isinstance(context, FusedOutputProcessorContext):
        raise ValueError(
            f"output_processor_context: expected a FusedOutputProcessorContext, got {type(context).__name__}"
        )
    if labels is None:
        raise ValueError(
            "labels: fused_output_processor computes log-probs of the labels, so GPTModel.forward needs labels="
        )
    check_output_layer_has_no_bias(output_layer)
    weight = resolve_output_weight(output_layer, output_weight)
    tp = tensor_parallel_layout(output_layer)
    rows = hidden_states.shape[0] * (tp.size if tp.tp_hidden == "sequence_sharded" else 1)
    if (rows, hidden_states.shape[1]) != labels.shape[::-1]:
        raise ValueError(
            f"labels: expected [b, s] = {(hidden_states.shape[1], rows)} to match hidden states [s, b, h] "
            f"{(rows, *hidden_states.shape[1:])}, got {tuple(labels.shape)}"
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
        tp_group=tp.group,
        tp_hidden=tp.tp_hidden,
        # a mask on the host stays there: the op finds its rows without waiting for the GPU
        score_mask=None if context.score_mask is None else context.score_mask.t(),
        vocab_size=context.vocab_size,
        calculate_entropy=context.calculate_entropy,
        backend=context.backend,
        gradient_accumulation_fusion=adds_weight_grad_to_main_grad(output_layer, weight, context.backend),
        batch_invariant=context.batch_invariant,
    )
    if context.loss_fn is not None:
        if context.loss_row_groups is not None and context.loss_row_groups.shape != labels.shape:
            raise ValueError(
                f"FusedOutputProcessorContext.loss_row_groups: must be shaped like labels [b, s] = "
                f"{tuple(labels.shape)}, "
                f"got {tuple(context.loss_row_groups.shape)}"
            )
        row_groups = None if context.loss_row_groups is None else context.loss_row_groups.to(labels.device).t()
        fused = log_probs_entropy_and_loss(
            hidden_states,
            weight,
            labels_sb,
            **problem,
            loss_fn=context.loss_fn,
            loss_name=context.loss_name,
            chunk_rows=context.tile_rows,
            row_gradients=context.row_gradients,
            host_loss_fn=context.host_loss_fn,
            chunk_bytes=context.loss_chunk_bytes,
            row_groups=row_groups,
        )
        output = _make_output(fused.log_probs.t().contiguous(), _transposed(fused.entropy), hidden_states)
        output.loss, output.loss_metrics = fused.loss, fused.metrics
        return output
    if context.replay is not None:
        return _replayed_outputs(hidden_states, weight, labels_sb, labels, context, problem)
    if context.asks_token_outputs:
        return _token_outputs(hidden_states, weight, labels_sb, labels, context, problem)
    log_probs, entropy = log_probs_and_entropy(
        hidden_states,
        weight,
        labels_sb,
        **problem,
        tile_rows=context.tile_rows,
        keep_logits_bytes=context.keep_logits_bytes,
    )
    log_probs = log_probs.t().contiguous()
    entropy = _transposed(entropy)
    if context.as_tuple:
        return (log_probs, entropy) if entropy is not None else (log_probs,)
    return _make_output(log_probs, entropy, hidden_states)
