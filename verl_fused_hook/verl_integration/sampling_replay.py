"""Sampling replay in verl: the rollout's top-k / top-p, checked against the switch at start-up and carried to the plan.

Why here and not in the build gate alone: verl's Megatron engine is built from the model and engine configs only
(`TrainingWorker` gets `actor_rollout_ref.model` and `.actor`/`.ref`), never the rollout's. The earliest place both
are in hand is `ActorRolloutRefWorker.init_model` (its `config.rollout` and `config.model`), which builds the actor
and reference engines. We wrap it to note the rollout's sampling for the engines built inside it; the build gate
(`call_sites._maybe_enable_fused_kernels`) then refuses a replay that cannot mean anything, with the reason, and
stores the rollout's top_k / top_p on the plan. An engine built elsewhere (an SFT trainer, a test) names its
sampling with `rollout_sampling(...)` around the build, or replay refuses to start.

The temperature is not taken here: verl hands each step's (the rollout's) temperature to the engine forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch

from ..context import SamplingReplay
from ..log_once import log_once
from ..switch import CONFIG_PREFIX, CONFIG_REPLAY_KEY, CONFIG_REPLAY_MAX_KEPT_KEY, FusedForwardPlan

logger = logging.getLogger(__name__)

ROLLOUT_PREFIX = "actor_rollout_ref.rollout"
PROCESSED_LOGPROBS = "processed_logprobs"  # vLLM's log-probs renormalized over the kept set (verl's default)


@dataclass(frozen=True)
class RolloutSampling:
    """The rollout's truncation as its config states it (verl's RolloutConfig fields of the same names)."""

    top_k: int = -1
    top_p: float = 1.0
    logprobs_mode: str | None = PROCESSED_LOGPROBS


_sampling: contextvars.ContextVar[RolloutSampling | None] = contextvars.ContextVar(
    "verl_fused_hook_rollout_sampling", default=None
)


@contextlib.contextmanager
def rollout_sampling(sampling: RolloutSampling):
    """Engines built inside this block replay `sampling` (when their plan turns replay on)."""
    token = _sampling.set(sampling)
    try:
        yield
    finally:
        _sampling.reset(token)


def sampling_of_rollout_config(rollout) -> RolloutSampling:
    """RolloutSampling from verl's `actor_rollout_ref.rollout` (a DictConfig or RolloutConfig)."""
    return RolloutSampling(
        top_k=int(rollout.get("top_k", -1)) if hasattr(rollout, "get") else int(rollout.top_k),
        top_p=float(rollout.get("top_p", 1.0)) if hasattr(rollout, "get") else float(rollout.top_p),
        logprobs_mode=(
            rollout.get("logprobs_mode", PROCESSED_LOGPROBS)
            if hasattr(rollout, "get")
            else getattr(rollout, "logprobs_mode", PROCESSED_LOGPROBS)
        ),
    )


def replay_refusal(plan: FusedForwardPlan, sampling: RolloutSampling | None) -> str | None:
    """Why replay on this plan cannot mean anything with this rollout, or None when it can."""
    switch = f"{CONFIG_PREFIX}.{CONFIG_REPLAY_KEY}=true"
    if sampling is None:
        return (
            f"{switch} needs the rollout's top_k / top_p, and this engine was built outside verl's "
            "ActorRolloutRefWorker.init_model (where verl_fused_hook reads actor_rollout_ref.rollout); build it inside "
            "verl_fused_hook.verl_integration.sampling_replay.rollout_sampling(...) or set the entry to false"
        )
    if sampling.top_k == -1 and sampling.top_p == 1.0:
        return (
            f"{switch}: no truncation configured ({ROLLOUT_PREFIX}.top_k=-1 and {ROLLOUT_PREFIX}.top_p=1), so every "
            f"kept set is the whole vocabulary; set {ROLLOUT_PREFIX}.top_k >= 1 or {ROLLOUT_PREFIX}.top_p < 1, or the "
            "entry to false"
        )
    if sampling.logprobs_mode != PROCESSED_LOGPROBS:
        return (
            f"{switch}: {ROLLOUT_PREFIX}.logprobs_mode={sampling.logprobs_mode!r} returns log-probs that are not "
            f"renormalized over the kept set; use {ROLLOUT_PREFIX}.logprobs_mode={PROCESSED_LOGPROBS}, or the entry "
            "to false"
        )
    if sampling.top_k > plan.replay_max_kept:
        return (
            f"{CONFIG_PREFIX}.{CONFIG_REPLAY_MAX_KEPT_KEY}={plan.replay_max_kept} is smaller than "
            f"{ROLLOUT_PREFIX}.top_k={sampling.top_k}; use an integer >= {sampling.top_k}"
        )
    return None


def plan_with_rollout_sampling(plan: FusedForwardPlan) -> FusedForwardPlan:
    """The plan with the rollout's top_k / top_p when it turns replay on (ValueError with the reason when replay
    cannot mean anything); any other plan unchanged. Logs one line when replay is on."""
    if not plan.sampling_replay:
        return plan
    sampling = _sampling.get()
    reason = replay_refusal(plan, sampling)
    if reason is not None:
        raise ValueError(reason)
    log_once(
        logger,
        f"verl_fused_hook: {CONFIG_REPLAY_KEY}: log-probs renormalized over the rollout's kept sets (top_k="
        f"{sampling.top_k}, top_p={sampling.top_p:g}, at most {plan.replay_max_kept} ids per token)",
    )
    return dataclasses.replace(plan, replay_top_k=sampling.top_k, replay_top_p=sampling.top_p)


def make_init_model(original):
    """Wrap `ActorRolloutRefWorker.init_model`: its engines are built knowing the rollout's sampling."""

    @functools.wraps(original)
    def init_model(self, *args, **kwargs):
        rollout = self.config.get("rollout") if hasattr(self.config, "get") else None
        if rollout is None:
            return original(self, *args, **kwargs)
        with rollout_sampling(sampling_of_rollout_config(rollout)):
            return original(self, *args, **kwargs)

    return init_model


def install_init_model_wrapper(workers_module) -> None:
    """Replace `ActorRolloutRefWorker.init_model` (idempotent; `replacements.restore` puts verl's back)."""
    from .replacements import replace

    replace(workers_module.ActorRolloutRefWorker, "init_model", make_init_model)


KEPT_IDS_KEY = "rollout_kept_ids"  # the rollout's kept sets in the batch: [bs, response_len, k], -1 padding


def step_replay(batch, plan: FusedForwardPlan, prompt_lens, response_lens) -> SamplingReplay:
    """The step's SamplingReplay: the batch's `rollout_kept_ids` laid out by prediction row (nested like input_ids
    plus a last dim, -1 where a row has no set), or none given: the plan's top_k / top_p computed from pi's logits.

    `rollout_kept_ids[i, j]` is the set the rollout sampled response token j of sequence i from (row-aligned with
    `responses` and `rollout_log_probs`); it is predicted at position prompt_len_i - 1 + j of input_ids."""
    replay = SamplingReplay(top_k=plan.replay_top_k, top_p=plan.replay_top_p, max_kept=plan.replay_max_kept)
    if KEPT_IDS_KEY not in batch.keys():
        return replay
    kept = batch[KEPT_IDS_KEY]
    if kept.is_floating_point() or kept.dim() != 3 or kept.shape[0] != len(response_lens):
        raise ValueError(
            f"{KEPT_IDS_KEY}: expected integer ids [batch, response_len, k] (-1 padding) = [{len(response_lens)}, "
            f"..., ...], got {kept.dtype} {tuple(kept.shape)}"
        )
    if kept.is_nested:
        kept = torch.nested.to_padded_tensor(kept, -1)
    if len(response_lens) and int(response_lens.max()) > kept.shape[1]:
        raise ValueError(
            f"{KEPT_IDS_KEY}: holds {kept.shape[1]} response positions, the longest response has "
            f"{int(response_lens.max())}"
        )
    offsets = batch["input_ids"].offsets().to(kept.device)
    prompt_lens, response_lens = prompt_lens.to(kept.device), response_lens.to(kept.device)
    rows = torch.full((int(offsets[-1]), kept.shape[2]), -1, dtype=torch.long, device=kept.device)
    sample = torch.arange(kept.shape[0], device=kept.device).repeat_interleave(response_lens)
    position = torch.arange(int(response_lens.sum()), device=kept.device) - (
        response_lens.cumsum(0) - response_lens
    ).repeat_interleave(response_lens)
    rows[offsets[sample] + prompt_lens[sample] - 1 + position] = kept[sample, position].long()
    nested = torch.nested.nested_tensor_from_jagged(rows, offsets=offsets)
    # one more than max_kept: a set pi_old computed holds up to max_kept ids plus its label where the rule dropped it
    return dataclasses.replace(replay, kept_ids=nested, max_kept=plan.replay_max_kept + 1)
