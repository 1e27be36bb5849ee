"""Which of verl's losses the op can compute inside its one pass, and the request a training step makes.

Why a table, read from verl 0.9.1's `core_algos.py`: the op differentiates the
loss chunk by chunk, before later chunks' log-probs exist, so it is exact only
when a row's gradient depends on values the chunk already holds:

- token-separable (a row's gradient depends on that row only): vanilla, dppo_tv,
  dppo_kl (their valid masks and truncated ratios are per token and detached),
  sapo (per-token gates), gpg, dro, cispo (detached clipped ratio), and verl's
  `sft_loss` (a masked log-prob sum);
- sequence-separable (on its own sequence only): gspo (the sequence ratio, detached,
  scales every token of its sequence), geo_mean (one geometric-mean ratio per
  sequence); the op then keeps each sequence's rows in one chunk (`row_groups`);
- not separable: clip_cov and kl_cov pick the tokens they clip from whole-batch
  statistics of the values;
- bypass_mode: as its rollout correction: batch-normalized IS weights are not
  separable, sequence-level IS or rejection sequence-separable, else token-separable;
- `distillation_ppo_loss` with one of verl's single-sample estimators (k1/kl, k2,
  k3/low_var_kl, abs, mse: `compute_distillation_loss_reverse_kl_estimator`): each
  token's loss is `kl_penalty` of its own log-prob and the teacher's (data), clamped
  per token to +-loss_max_clamp, then either aggregated (`agg_loss`) or used, detached,
  as the advantage of verl's vanilla policy loss (`use_policy_gradient`): token-separable;
  plus `ppo_loss` when `use_task_rewards` (its own separability). `forward_kl_topk` is
  not fused: its per-token KL comes from the op `token_log_probs` in the hook
  (distillation.py), which the loss-inside op does not compute.

Every aggregation (`agg_loss`: its normalizers are masks and batch sizes, never
values), entropy coefficient, KL loss and rollout importance weights keep that
property. Anything else runs verl's two-pass path and says so once in the log; the
op re-checks separability on every call and raises if the table were wrong.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..log_once import log_once

logger = logging.getLogger(__name__)

# The model output key that carries the fused (loss, metrics) from the engine forward to verl's postprocess.
FUSED_LOSS_OUTPUT_KEY = "verl_fused_hook_loss"

TOKEN, SEQUENCE = "token", "sequence"
POLICY_LOSS_SEPARABILITY = {
    "vanilla": TOKEN,
    "dppo_tv": TOKEN,
    "dppo_kl": TOKEN,
    "sapo": TOKEN,
    "gpg": TOKEN,
    "dro": TOKEN,
    "cispo": TOKEN,
    "gspo": SEQUENCE,
    "geo_mean": SEQUENCE,
}
NOT_SEPARABLE = {
    "clip_cov": "clips tokens chosen from whole-batch covariance statistics",
    "kl_cov": "penalizes tokens chosen from whole-batch covariance statistics",
}
SUPPORTED_POLICY_LOSS_MODES = (*POLICY_LOSS_SEPARABILITY, "bypass_mode")
SUPPORTED_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
SUPPORTED_KL_LOSS_TYPES = (
    "kl",
    "k1",
    "abs",
    "mse",
    "k2",
    "low_var_kl",
    "k3",
    "kl+",
    "k1+",
    "abs+",
    "low_var_kl+",
    "k3+",
)


def policy_loss_mode(config) -> str:
    return config.policy_loss.get("loss_mode", "vanilla")


def _bypass_separability(config) -> tuple[str | None, str | None]:
    """bypass_mode's separability follows its rollout correction (verl's rollout_corr_helper)."""
    correction = config.policy_loss.get("rollout_correction", None) or {}
    if correction.get("rollout_is_batch_normalize", False):
        return None, "policy_loss.loss_mode=bypass_mode with rollout_is_batch_normalize=True (batch-normalized weights)"
    rejection = str(correction.get("rollout_rs", None) or "")
    sequence_level = correction.get("rollout_is", None) == "sequence" or any(
        option.strip().startswith("seq_") for option in rejection.split(",")
    )
    if rejection and config.loss_agg_mode == "seq-mean-token-mean":
        sequence_level = True  # a rejected token changes its sequence's token count
    return (SEQUENCE if sequence_level else TOKEN), None


def ppo_loss_separability(config) -> tuple[str | None, str | None]:
    """(TOKEN or SEQUENCE, None) when `ppo_loss` with this ActorConfig can go inside the op, else (None, why not)."""
    mode = policy_loss_mode(config)
    if mode in NOT_SEPARABLE:
        return None, f"policy_loss.loss_mode={mode} ({NOT_SEPARABLE[mode]})"
    if mode not in SUPPORTED_POLICY_LOSS_MODES:
        return None, f"policy_loss.loss_mode={mode} (fused: {', '.join(SUPPORTED_POLICY_LOSS_MODES)})"
    if config.loss_agg_mode not in SUPPORTED_AGG_MODES:
        return None, f"loss_agg_mode={config.loss_agg_mode} (fused: {', '.join(SUPPORTED_AGG_MODES)})"
    if config.use_kl_loss and config.kl_loss_type not in SUPPORTED_KL_LOSS_TYPES:
        return None, f"kl_loss_type={config.kl_loss_type} (fused: {', '.join(SUPPORTED_KL_LOSS_TYPES)})"
    if mode == "bypass_mode":
        return _bypass_separability(config)
    return POLICY_LOSS_SEPARABILITY[mode], None


def unsupported_reason(config) -> str | None:
    """None when `ppo_loss` with this ActorConfig can go inside the op, else why it is not fused."""
    return ppo_loss_separability(config)[1]


def ppo_loss_name(config) -> str:
    return f"ppo_loss(loss_mode={policy_loss_mode(config)}, loss_agg_mode={config.loss_agg_mode})"


@dataclass(frozen=True)
class FusedLossRequest:
    """What the engine forward needs to run a step's loss inside the op."""

    loss_function: Callable
    config: Any  # the ActorConfig bound to ppo_loss (None for sft_loss)
    data: Any  # the micro-batch TensorDict, on the model's device
    host_data: Any  # the same on the host, for the op's final evaluation (ppo_loss_on_host)
    dp_group: Any
    name: str
    separability: str  # TOKEN or SEQUENCE: whether the op must keep each sequence's rows in one chunk
    chunk_bytes: int | None = None  # output_processor_fused_loss_chunk_gib (None: the op's default)
    cp_rank: int | None = None  # this rank's context-parallel rank under CP > 1 (cp_loss.py), else None


def _bound(loss_function, verl_function) -> dict | None:
    """The keywords `loss_function` binds when it is `functools.partial(verl_function, ...)`, else None."""
    if isinstance(loss_function, functools.partial) and loss_function.func is verl_function and not loss_function.args:
        return loss_function.keywords
    return None


def distillation_loss_name(config, distillation_config) -> str:
    loss = distillation_config.distillation_loss
    return (
        f"distillation_ppo_loss(loss_mode={loss.loss_mode}, use_policy_gradient={loss.use_policy_gradient}, "
        f"use_task_rewards={loss.use_task_rewards}, loss_agg_mode={config.loss_agg_mode})"
    )


def distillation_separability(config, distillation_config) -> tuple[str | None, str | None]:
    """(TOKEN or SEQUENCE, None) when `distillation_ppo_loss` with these configs can go inside the op, else
    (None, why not)."""
    from verl.trainer.distillation.losses import (
        compute_distillation_loss_reverse_kl_estimator,
        get_distillation_loss_fn,
    )

    loss = distillation_config.distillation_loss
    if loss.loss_settings.use_topk:
        return None, (
            f"distillation loss_mode={loss.loss_mode} (its per-token KL comes from the op token_log_probs in the "
            "hook, not from inside the loss-inside op)"
        )
    if get_distillation_loss_fn(loss.loss_mode) is not compute_distillation_loss_reverse_kl_estimator:
        return None, f"distillation loss_mode={loss.loss_mode} (fused: verl's single-sample KL estimators)"
    if config.loss_agg_mode not in SUPPORTED_AGG_MODES:
        return None, f"loss_agg_mode={config.loss_agg_mode} (fused: {', '.join(SUPPORTED_AGG_MODES)})"
    if loss.use_task_rewards:  # ppo_loss's value is part of the loss
        return ppo_loss_separability(config)
    return TOKEN, None


def _separability_of(loss_function) -> tuple[str | None, Any, str]:
    """(TOKEN/SEQUENCE or None, the bound ActorConfig when its fast row gradients apply, the loss's name or why it
    is not fused)."""
    from verl.trainer.distillation.losses import distillation_ppo_loss
    from verl.workers.utils.losses import ppo_loss, sft_loss

    if _bound(loss_function, sft_loss) is not None:
        return TOKEN, None, "sft_loss"
    keywords = _bound(loss_function, distillation_ppo_loss)
    if keywords is not None and keywords.get("config") is not None and keywords.get("distillation_config") is not None:
        config, distillation_config = keywords["config"], keywords["distillation_config"]
        kind, reason = distillation_separability(config, distillation_config)
        name = distillation_loss_name(config, distillation_config)
        # the fast row gradients are ppo_loss's alone: the op differentiates the whole loss per chunk
        return kind, None, name if kind is not None else f"{name}: {reason} is not fused"
    keywords = _bound(loss_function, ppo_loss)
    if keywords is None or keywords.get("config") is None:
        name = getattr(getattr(loss_function, "func", loss_function), "__name__", repr(loss_function))
        return None, None, f"loss {name} is not ppo_loss, distillation_ppo_loss or sft_loss"
    config = keywords["config"]
    kind, reason = ppo_loss_separability(config)
    return kind, config, ppo_loss_name(config) if kind is not None else f"{reason} is not separable"


def fused_loss_request(
    engine, batch, loss_function, forward_only: bool, chunk_bytes: int | None = None
) -> FusedLossRequest | None:
    """The step's request to fuse `loss_function`, or None for verl's two-pass path (logged once per reason;
    a forward-only step has no loss to fuse and is not logged)."""
    if forward_only or loss_function is None or not torch.is_grad_enabled():
        return None
    kind, config, name = _separability_of(loss_function)
    if kind is None:
        log_once(logger, f"verl_fused_hook: output_processor_fused_loss: {name}; two-pass path")
        return None
    cp_rank = None
    if getattr(engine.engine_config, "dynamic_context_parallel", False):
        log_once(
            logger, "verl_fused_hook: output_processor_fused_loss: dynamic context parallelism not fused; two-pass path"
        )
        return None
    if engine.engine_config.context_parallel_size > 1:
        if kind == SEQUENCE:  # its row gradients need whole sequences, whose rows every CP rank shares
            log_once(
                logger,
                f"verl_fused_hook: output_processor_fused_loss: {name} is sequence-level, and context parallelism "
                "splits every sequence over the CP ranks; two-pass path",
            )
            return None
        from megatron.core import parallel_state

        cp_rank = parallel_state.get_context_parallel_rank()  # cp_loss.py: no collective per chunk
    from verl.utils.device import get_device_id

    return FusedLossRequest(
        loss_function=loss_function,
        config=config,
        data=batch.to(get_device_id()),
        host_data=batch.to("cpu") if cp_rank is None else None,  # under CP the final evaluation gathers on the device
        dp_group=engine.get_data_parallel_group(),
        name=name,
        separability=kind,
        chunk_bytes=chunk_bytes,
        cp_rank=cp_rank,
    )


def fused_result_loss(model_output, data, dp_group=None):
    """verl's loss_function for a fused step: the (loss, metrics) the op computed, taken out of the output."""
    return model_output.pop(FUSED_LOSS_OUTPUT_KEY)
