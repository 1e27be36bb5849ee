"""verl's losses as the op's `loss_fn`: the op's rows put back into verl's layout, and fast per-row gradients.

Why: the op works on the model's [s, b] rows; verl's loss functions read jagged,
then padded, per-response-token tensors. `ppo_loss_of_rows` hands the op's values
to verl's own loss exactly as verl's postprocess would (so loss and metrics are
verl's); `ppo_row_gradients` gives, for vanilla and gspo, the same per-row
gradients in a few elementwise ops per chunk instead of a whole-batch loss call
(the op checks them against autograd of verl's loss on every call); `row_groups`
tells the op which rows form one sequence, for sequence-level losses.
Which losses qualify is loss_support.py's table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from ..log_once import log_once

logger = logging.getLogger(__name__)


def ppo_loss_of_rows(loss_function, data, to_nested: Callable[[torch.Tensor], torch.Tensor], dp_group=None):
    """The op's loss_fn: the op's per-row log-probs/entropy put back into verl's jagged layout by
    `to_nested`, then verl's own loss function on them, exactly as verl's postprocess calls it."""

    def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor | None):
        model_output = {"log_probs": to_nested(log_probs)}
        if entropy is not None:
            model_output["entropy"] = to_nested(entropy)
        return loss_function(model_output=model_output, data=data, dp_group=dp_group)

    return loss_fn


def ppo_loss_on_host(
    loss_function,
    host_data,
    to_nested: Callable[[torch.Tensor], torch.Tensor],
    row_shape: torch.Size,
    device,
    dp_group=None,
):
    """The op's host_loss_fn: `ppo_loss_of_rows` on host tensors, with `host_data` the micro-batch on the host;
    None (the op then evaluates on the device, logged once) if verl's unpacking is not a plain jagged tensor.

    verl's unpacking runs on the device; which op row each value of its jagged output holds is read once
    per micro-batch by unpacking row ids, so the host only gathers rows and rebuilds the same jagged tensor.
    """
    ids = to_nested(torch.arange(row_shape.numel(), dtype=torch.float64, device=device).view(row_shape))
    if getattr(ids, "_lengths", None) is not None:
        log_once(
            logger,
            "verl_fused_hook: output_processor_fused_loss: verl's unpacking gave a jagged tensor with holes; "
            "ppo_loss's final evaluation stays on the device (slower, same values)",
        )
        return None
    value_rows = ids.values().round().long().cpu()
    offsets = ids.offsets().cpu()

    def to_nested_on_host(rows: torch.Tensor) -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(rows.reshape(-1).index_select(0, value_rows), offsets)

    return ppo_loss_of_rows(loss_function, host_data, to_nested_on_host, dp_group)


def _clip_range(config) -> tuple[float, float]:
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return low, high


def _clipped_policy_loss(config, log_prob, old_log_prob, advantages):
    """Per-token dual-clip PPO loss, as verl's compute_policy_loss_vanilla defines it (before aggregation)."""
    low, high = _clip_range(config)
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    unclipped_or_clipped = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - low, 1 + high))
    dual_clipped = torch.minimum(-advantages * config.get("clip_ratio_c", 3.0), unclipped_or_clipped)
    return torch.where(advantages < 0, dual_clipped, unclipped_or_clipped)


def _sequence_policy_loss(config, log_prob, old_log_prob, advantages, sequence_log_ratio):
    """Per-token GSPO loss, as verl's compute_policy_loss_gspo defines it (before aggregation): the token's
    ratio carries its sequence's mean log-ratio, detached, so only the token's own log-prob is differentiated."""
    low, high = _clip_range(config)
    log_ratio = torch.clamp(log_prob - log_prob.detach() + sequence_log_ratio.detach(), max=10.0)
    ratio = torch.exp(log_ratio)
    return torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - low, 1 + high))


FAST_ROW_GRADIENT_MODES = ("vanilla", "gspo")


def ppo_row_gradients(config, data, to_nested: Callable[[torch.Tensor], torch.Tensor], row_shape: torch.Size, device):
    """The op's row_gradients for `ppo_loss(config)` on `data` (see ops.loss_inside) when its policy loss mode
    has a fast form (FAST_ROW_GRADIENT_MODES; else None: the op differentiates verl's loss per chunk): per
    chunk, a few elementwise ops on the chunk's rows instead of a whole ppo_loss call. gspo's needs each
    sequence's rows in one chunk (`row_groups`), as its loss does.

    Built once per micro-batch: which padded response position each op row lands on (an index pushed
    through the same `to_nested` and verl's no_padding_2_padding), the padded per-token fields, and
    the aggregation weight of every position (the gradient of verl's own agg_loss, which is linear in
    the per-token losses). The op checks the result against autograd of the real ppo_loss on every call.
    """
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
    from verl.workers.utils.padding import no_padding_2_padding

    from .loss_support import policy_loss_mode

    mode = policy_loss_mode(config)
    if mode not in FAST_ROW_GRADIENT_MODES:
        return None
    n_rows = row_shape.numel()
    row_ids = torch.arange(1, n_rows + 1, dtype=torch.float64, device=device).view(row_shape)
    padded_rows = no_padding_2_padding(to_nested(row_ids), data).round().long() - 1  # -1: padding
    position_of_row = torch.full((n_rows,), -1, dtype=torch.long, device=device)
    real = padded_rows.reshape(-1) >= 0
    position_of_row[padded_rows.reshape(-1)[real]] = torch.arange(padded_rows.numel(), device=device)[real]

    fields = ["response_mask", "old_log_probs", "advantages"]
    fields += [key for key in ("rollout_is_weights", "ref_log_prob") if key in data.keys()]
    padded = data.select(*fields).to_padded_tensor()
    response_mask = padded["response_mask"].to(bool)
    batch_info = dict(
        dp_size=data["dp_size"],
        batch_num_tokens=data["batch_num_tokens"],
        global_batch_size=data["global_batch_size"],
        loss_scale_factor=config.loss_scale_factor,
    )
    with torch.enable_grad():
        probe = torch.zeros(response_mask.shape, dtype=torch.float32, device=device, requires_grad=True)
        weights = torch.autograd.grad(agg_loss(probe, response_mask, config.loss_agg_mode, **batch_info), probe)[0]

    def flat(name):
        return padded[name].reshape(-1).float() if name in padded.keys() else None

    weights = weights.reshape(-1)
    old_log_prob, advantages, mask = flat("old_log_probs"), flat("advantages"), flat("response_mask")
    rollout_weights, ref_log_prob = flat("rollout_is_weights"), flat("ref_log_prob")
    sequence_lengths = response_mask.sum(dim=-1).clamp(min=1)
    if config.use_kl_loss and ref_log_prob is None:
        raise ValueError("use_kl_loss: the batch has no ref_log_prob (ppo_loss would fail the same way)")

    def sequence_log_ratio(lp, at, read):
        """Each position's sequence mean of (log_prob - old) * mask, summed per padded row as verl sums it;
        exact for the sequences whose rows are all in this chunk (the others are not read)."""
        # index_put_ with accumulate: rows verl does not read add an exact 0 at position 0; no boolean
        # indexing, so no host synchronization per chunk
        contribution = (lp - old_log_prob.index_select(0, at)) * mask.index_select(0, at) * read
        terms = torch.zeros_like(old_log_prob).index_put_((at,), contribution, accumulate=True)
        per_sequence = terms.view(response_mask.shape).sum(dim=-1) / sequence_lengths
        return per_sequence.index_select(0, at // response_mask.shape[-1])

    def row_gradients(rows, log_prob, entropy):
        position = position_of_row.index_select(0, rows)
        read = position >= 0
        at = position.clamp_min(0)
        weight = weights.index_select(0, at) * read
        old, advantage = old_log_prob.index_select(0, at), advantages.index_select(0, at)
        with torch.enable_grad():
            lp = log_prob.detach().requires_grad_(True)
            if mode == "gspo":
                token_loss = _sequence_policy_loss(config, lp, old, advantage, sequence_log_ratio(lp, at, read))
            else:
                token_loss = _clipped_policy_loss(config, lp, old, advantage)
            if rollout_weights is not None:
                token_loss = token_loss * rollout_weights.index_select(0, at)
            if config.use_kl_loss:
                kl = kl_penalty(
                    logprob=lp, ref_logprob=ref_log_prob.index_select(0, at), kl_penalty=config.kl_loss_type
                )
                token_loss = token_loss + config.kl_loss_coef * kl
            (g_lp,) = torch.autograd.grad((token_loss * weight).sum(), lp)
        g_ent = None if entropy is None else -config.entropy_coeff * weight
        return g_lp, g_ent

    return row_gradients


def row_groups(to_nested: Callable[[torch.Tensor], torch.Tensor], row_shape: torch.Size, device) -> torch.Tensor:
    """int64 shaped like the op's rows: the sequence each row belongs to in verl's jagged layout (pushed
    through the same `to_nested`), -1 for rows of no sequence (packing padding)."""
    n_rows = row_shape.numel()
    ids = to_nested(torch.arange(n_rows, dtype=torch.float64, device=device).view(row_shape))
    groups = torch.full((n_rows,), -1, dtype=torch.long, device=device)
    lengths = ids.offsets().diff()
    groups[ids.values().round().long()] = torch.arange(lengths.numel(), device=device).repeat_interleave(lengths)
    return groups.view(row_shape)
