"""verl's `ppo_loss` as the op's fused loss: which configurations qualify, and the per-row loss function.

Why a list: the op's one-pass gradient is exact only for token-separable losses
(row i's gradient depends on row i alone). verl's vanilla clipped loss, every
token-level aggregation (its normalizers depend on masks and batch sizes, never
on values), the entropy bonus, the KL loss and rollout importance weights are;
sequence-level ratios (GSPO and friends) are not. Anything outside the list runs
verl's two-pass path and says so once in the log; the op also re-checks
separability on every call and raises if it fails.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

logger = logging.getLogger(__name__)

# The model output key that carries the fused (loss, metrics) from the engine forward to verl's postprocess.
FUSED_LOSS_OUTPUT_KEY = "verl_fused_hook_loss"

SUPPORTED_POLICY_LOSS_MODES = ("vanilla",)
SUPPORTED_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
SUPPORTED_KL_LOSS_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "kl+", "k1+", "abs+", "low_var_kl+", "k3+")


def policy_loss_mode(config) -> str:
    return config.policy_loss.get("loss_mode", "vanilla")


def unsupported_reason(config) -> str | None:
    """None when `ppo_loss` with this ActorConfig is token-separable, else why it is not fused."""
    mode = policy_loss_mode(config)
    if mode not in SUPPORTED_POLICY_LOSS_MODES:
        return f"policy_loss.loss_mode={mode} (fused: {', '.join(SUPPORTED_POLICY_LOSS_MODES)})"
    if config.loss_agg_mode not in SUPPORTED_AGG_MODES:
        return f"loss_agg_mode={config.loss_agg_mode} (fused: {', '.join(SUPPORTED_AGG_MODES)})"
    if config.use_kl_loss and config.kl_loss_type not in SUPPORTED_KL_LOSS_TYPES:
        return f"kl_loss_type={config.kl_loss_type} (fused: {', '.join(SUPPORTED_KL_LOSS_TYPES)})"
    return None


def ppo_loss_name(config) -> str:
    return f"ppo_loss(loss_mode={policy_loss_mode(config)}, loss_agg_mode={config.loss_agg_mode})"


def ppo_loss_of_rows(loss_function, data, to_nested: Callable[[torch.Tensor], torch.Tensor], dp_group=None):
    """The op's loss_fn: the op's per-row log-probs/entropy put back into verl's jagged layout by
    `to_nested`, then verl's own loss function on them, exactly as verl's postprocess calls it."""

    def loss_fn(log_probs: torch.Tensor, entropy: torch.Tensor | None):
        model_output = {"log_probs": to_nested(log_probs)}
        if entropy is not None:
            model_output["entropy"] = to_nested(entropy)
        return loss_function(model_output=model_output, data=data, dp_group=dp_group)

    return loss_fn


def ppo_loss_on_host(loss_function, host_data, to_nested: Callable[[torch.Tensor], torch.Tensor], row_shape: torch.Size,
                     device, dp_group=None):
    """The op's host_loss_fn: `ppo_loss_of_rows` on host tensors, with `host_data` the micro-batch on the host;
    None (the op then evaluates on the device, logged once) if verl's unpacking is not a plain jagged tensor.

    verl's unpacking runs on the device; which op row each value of its jagged output holds is read once
    per micro-batch by unpacking row ids, so the host only gathers rows and rebuilds the same jagged tensor.
    """
    ids = to_nested(torch.arange(row_shape.numel(), dtype=torch.float64, device=device).view(row_shape))
    if getattr(ids, "_lengths", None) is not None:
        _log_once(
            "verl_fused_hook: output_processor_fused_loss: verl's unpacking gave a jagged tensor with holes; "
            "ppo_loss's final evaluation stays on the device (slower, same values)"
        )
        return None
    value_rows = ids.values().round().long().cpu()
    offsets = ids.offsets().cpu()

    def to_nested_on_host(rows: torch.Tensor) -> torch.Tensor:
        return torch.nested.nested_tensor_from_jagged(rows.reshape(-1).index_select(0, value_rows), offsets)

    return ppo_loss_of_rows(loss_function, host_data, to_nested_on_host, dp_group)


@dataclass(frozen=True)
class FusedLossRequest:
    """What the engine forward needs to run a step's ppo_loss inside the op."""

    loss_function: Callable
    config: Any  # the ActorConfig bound to ppo_loss
    data: Any  # the micro-batch TensorDict, on the model's device
    host_data: Any  # the same on the host, for the op's final evaluation (ppo_loss_on_host)
    dp_group: Any
    name: str
    chunk_bytes: int | None = None  # output_processor_fused_loss_chunk_gib (None: the op's default)


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logger.info(message)


def _ppo_config(loss_function):
    from verl.workers.utils.losses import ppo_loss

    if isinstance(loss_function, functools.partial) and loss_function.func is ppo_loss and not loss_function.args:
        return loss_function.keywords.get("config")
    return None


def fused_loss_request(engine, batch, loss_function, forward_only: bool, chunk_bytes: int | None = None) -> FusedLossRequest | None:
    """The step's request to fuse `loss_function`, or None for verl's two-pass path (logged once per reason;
    a forward-only step has no loss to fuse and is not logged)."""
    if forward_only or loss_function is None or not torch.is_grad_enabled():
        return None
    name = getattr(getattr(loss_function, "func", loss_function), "__name__", repr(loss_function))
    config = _ppo_config(loss_function)
    if config is None:
        _log_once(f"verl_fused_hook: output_processor_fused_loss: loss {name} is not ppo_loss; two-pass path")
        return None
    reason = unsupported_reason(config)
    if reason is not None:
        _log_once(f"verl_fused_hook: output_processor_fused_loss: {reason} is not token-separable; two-pass path")
        return None
    if engine.engine_config.context_parallel_size > 1 or getattr(engine.engine_config, "dynamic_context_parallel", False):
        # verl's unpacking gathers over the CP group: a collective per chunk that ranks with different
        # numbers of scored rows would not call in step
        _log_once("verl_fused_hook: output_processor_fused_loss: context parallelism not fused; two-pass path")
        return None
    from verl.utils.device import get_device_id

    return FusedLossRequest(
        loss_function=loss_function,
        config=config,
        data=batch.to(get_device_id()),
        host_data=batch.to("cpu"),
        dp_group=engine.get_data_parallel_group(),
        name=ppo_loss_name(config),
        chunk_bytes=chunk_bytes,
    )


def fused_result_loss(model_output, data, dp_group=None):
    """verl's loss_function for a fused step: the (loss, metrics) the op computed, taken out of the output."""
    return model_output.pop(FUSED_LOSS_OUTPUT_KEY)


def _clipped_policy_loss(config, log_prob, old_log_prob, advantages):
    """Per-token dual-clip PPO loss, as verl's compute_policy_loss_vanilla defines it (before aggregation)."""
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0))
    unclipped_or_clipped = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - low, 1 + high))
    dual_clipped = torch.minimum(-advantages * config.get("clip_ratio_c", 3.0), unclipped_or_clipped)
    return torch.where(advantages < 0, dual_clipped, unclipped_or_clipped)


def ppo_row_gradients(config, data, to_nested: Callable[[torch.Tensor], torch.Tensor], row_shape: torch.Size, device):
    """The op's row_gradients for `ppo_loss(config)` on `data` (see ops.loss_inside): per chunk, a few
    elementwise ops on the chunk's rows instead of a whole ppo_loss call.

    Built once per micro-batch: which padded response position each op row lands on (an index pushed
    through the same `to_nested` and verl's no_padding_2_padding), the padded per-token fields, and
    the aggregation weight of every position (the gradient of verl's own agg_loss, which is linear in
    the per-token losses). The op checks the result against autograd of the real ppo_loss on every call.
    """
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
    from verl.workers.utils.padding import no_padding_2_padding

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
    old_log_prob, advantages = flat("old_log_probs"), flat("advantages")
    rollout_weights, ref_log_prob = flat("rollout_is_weights"), flat("ref_log_prob")
    if config.use_kl_loss and ref_log_prob is None:
        raise ValueError("use_kl_loss: the batch has no ref_log_prob (ppo_loss would fail the same way)")

    def row_gradients(rows, log_prob, entropy):
        position = position_of_row.index_select(0, rows)
        read = position >= 0
        at = position.clamp_min(0)
        weight = weights.index_select(0, at) * read
        with torch.enable_grad():
            lp = log_prob.detach().requires_grad_(True)
            token_loss = _clipped_policy_loss(config, lp, old_log_prob.index_select(0, at), advantages.index_select(0, at))
            if rollout_weights is not None:
                token_loss = token_loss * rollout_weights.index_select(0, at)
            if config.use_kl_loss:
                kl = kl_penalty(logprob=lp, ref_logprob=ref_log_prob.index_select(0, at), kl_penalty=config.kl_loss_type)
                token_loss = token_loss + config.kl_loss_coef * kl
            (g_lp,) = torch.autograd.grad((token_loss * weight).sum(), lp)
        g_ent = None if entropy is None else -config.entropy_coeff * weight
        return g_lp, g_ent

    return row_gradients
