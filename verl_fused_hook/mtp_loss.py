"""megatron-core's MTP loss through the op: the MTP heads' cross-entropy without MTP logits.

Why: megatron-core 0.19's `process_mtp_loss` calls the output layer once per MTP
layer, so every MTP head materializes [tokens, vocab] logits (and their
gradient) even when the main head goes through the output_processor hook.
`fused_process_mtp_loss` takes the same arguments and has the same effects:
the loss of MTP layer k is minus the log-prob, at temperature 1 (MuP scale
included), of the label rolled k steps, masked by the loss mask rolled k
steps (packed and context-parallel rolls by megatron's own `roll_tensor`),
scaled and injected into the main hidden states with `MTPLossAutoScaler`
exactly as megatron does, and logged (loss and acceptance counts) through
megatron's `MTPLossLoggingHelper`. Acceptance (label == argmax) comes from
the op's `return_label_is_max`; a label tied with another id at the maximum
counts as accepted, where megatron's argmax accepts only the lowest tied id.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper, roll_tensor

from .ops import log_probs_and_entropy
from .output_layer import adds_weight_grad_to_main_grad, logit_multiplier, resolve_output_weight, tensor_parallel_layout
from .probe import SUPPORTED_MEGATRON, OutputProcessorUnsupportedError, installed_megatron_version


def megatron_mtp_gaps(config) -> list[str]:
    """The megatron-core names `fused_process_mtp_loss` reads that this release lacks (0.18.x lacks both; 0.19.0
    has them). Read from the objects, not the version string, so dev builds and backports pass."""
    gaps = []
    if not hasattr(config, "mtp_detach_heads"):
        gaps.append("TransformerConfig.mtp_detach_heads")
    if not hasattr(MTPLossLoggingHelper, "save_metrics_to_tracker"):
        gaps.append("MTPLossLoggingHelper.save_metrics_to_tracker")
    return gaps


def require_fused_mtp_support(config) -> None:
    """Refuse hook mode on an MTP model at build when megatron-core lacks what the fused MTP loss reads: the
    alternative is an AttributeError at the first training step."""
    gaps = megatron_mtp_gaps(config)
    if gaps:
        raise OutputProcessorUnsupportedError(
            f"hook mode on an MTP model needs megatron-core>={SUPPORTED_MEGATRON} for {' and '.join(gaps)}; "
            f"installed megatron-core is {installed_megatron_version()}. Upgrade with "
            f"`pip install 'megatron-core>={SUPPORTED_MEGATRON}'`, or set VERL_FUSED_USE_OP_HOOK=0 to keep verl's "
            "path (fused kernels off with MTP)"
        )


def fused_process_mtp_loss(
    *,
    hidden_states: torch.Tensor,
    labels: torch.Tensor | None,
    loss_mask: torch.Tensor | None,
    output_layer,
    output_weight: torch.Tensor | None,
    is_training: bool,
    config,
    cp_group=None,
    tp_group=None,
    packed_seq_params=None,
    scale_logits_fn=None,
    input_ids: torch.Tensor | None = None,
    backend: str = "auto",
    **_unused_logit_arguments,
) -> torch.Tensor:
    """Drop-in for megatron's `process_mtp_loss` (same keywords); returns the main hidden states
    with every MTP layer's loss attached by `MTPLossAutoScaler`.

    Accepts and ignores the arguments that only shape megatron's logits
    (`runtime_gather_output`, `compute_language_model_loss`): no logits exist here.
    """
    num_layers = config.mtp_num_layers
    chunks = torch.chunk(hidden_states, 1 + num_layers, dim=0)
    hidden_states = chunks[0]
    labels_from_input_ids = labels is None
    if labels_from_input_ids:
        if input_ids is None:
            return hidden_states
        labels, _ = roll_tensor(input_ids, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)

    weight = resolve_output_weight(output_layer, output_weight)
    if config.mtp_detach_heads:
        weight = weight.detach()
    tp = tensor_parallel_layout(output_layer, tp_group)
    temperature = 1.0 / logit_multiplier(scale_logits_fn, config)

    mtp_labels = labels.clone()
    if loss_mask is None:
        loss_mask = torch.ones_like(mtp_labels)
    if labels_from_input_ids:  # the last rolled-in label is fabricated: mask it, as megatron does
        loss_mask, _ = roll_tensor(
            loss_mask, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params
        )
    original_num_tokens = loss_mask.sum()

    for layer in range(num_layers):
        mtp_labels, _ = roll_tensor(
            mtp_labels, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params
        )
        loss_mask, num_tokens = roll_tensor(
            loss_mask, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params
        )
        log_probs, _, label_is_max = log_probs_and_entropy(
            chunks[layer + 1],
            weight,
            mtp_labels.t(),
            temperature=temperature,
            tp_group=tp.group,
            tp_hidden=tp.tp_hidden,
            score_mask=(loss_mask != 0).t(),
            calculate_entropy=False,
            backend=backend,
            return_label_is_max=True,
            gradient_accumulation_fusion=adds_weight_grad_to_main_grad(output_layer, weight, backend),
        )
        mtp_loss = loss_mask * -log_probs.t()

        if is_training:
            mtp_loss_for_log = (torch.sum(mtp_loss) * (num_tokens > 0).to(mtp_loss.dtype)) / num_tokens.clamp(min=1)
            valid = loss_mask.bool()
            MTPLossLoggingHelper.save_metrics_to_tracker(
                mtp_loss_for_log,
                (label_is_max.t() & valid).sum().float(),
                valid.sum().float(),
                layer,
                num_layers,
                avg_group=parallel_state.get_data_parallel_group(with_context_parallel=True),
            )
        mtp_loss_scale = config.mtp_loss_scaling_factor / num_layers
        if config.calculate_per_token_loss:
            # finalize_model_grads divides by the main loss's token count; MTP has fewer (rolled) tokens
            scaled = mtp_loss_scale * mtp_loss * (original_num_tokens / torch.clamp(num_tokens, min=1))
        else:
            scaled = mtp_loss_scale * mtp_loss / num_tokens.clamp(min=1)
        hidden_states = MTPLossAutoScaler.apply(hidden_states, scaled)
    return hidden_states
