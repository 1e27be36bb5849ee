"""verl's on-policy distillation as a user's command sets it up: the config composed by verl's Hydra config, the
loss function bound as verl's worker binds it, the trainer's step flags, and a teacher's top-k in a batch.

Why here: the distillation tests, the parallel-layout cases and `e2e-bench --distillation` must drive verl's
engine with what verl's trainer hands it. `distillation_config` composes `ppo_trainer` with
`distillation.enabled=true` and the loss entries, as `main_ppo` would (a teacher entry is required by verl's
validation; no teacher runs); `loss_function` is `ActorRolloutRefWorker`'s
`partial(distillation_ppo_loss, config=actor_config, distillation_config=...)`; `step_flags` are the non-tensor
entries verl's trainer sets on an actor update (`distillation_use_topk`, `distillation_only`); `add_teacher`
puts a teacher's top-k into the trainer's padded rollout (what `_pad_teacher_outputs` makes of a teacher's
prompt log-probs: pad id and log-prob 0 on padding), which verl's `left_right_2_no_padding` then nests;
`nested_teacher` gives the same for a batch already packed.
verl loads on first use (`import verl` starts ray).
"""

from __future__ import annotations

import functools
import os

import torch

from .grpo_batches import PAD_TOKEN_ID

TOPK = "forward_kl_topk"
# What the tests and e2e-bench call a distillation setup: verl's loss entries
# (actor_rollout_ref... distillation.distillation_loss.*). Student log-probs of the tiny random models sit near
# log(1/1000) = -6.9 and their per-token top-k KL spreads around 5.3: these clamps bind on part of the tokens.
PRESETS = {
    "topk": dict(loss_mode=TOPK, topk=16, use_policy_gradient=False, log_prob_min_clamp=-6.9, loss_max_clamp=5.3),
    "topk-pg": dict(loss_mode=TOPK, topk=16, use_policy_gradient=True, use_task_rewards=False),
    "topk-only": dict(loss_mode=TOPK, topk=16, use_policy_gradient=False, use_task_rewards=False),
    "k3": dict(loss_mode="k3", use_policy_gradient=False, loss_max_clamp=0.5),
    "k1": dict(loss_mode="k1", use_policy_gradient=True, loss_max_clamp=0.5),
}


@functools.cache
def _composed(entries: tuple[tuple[str, object], ...]):
    import importlib.util

    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    overrides = [
        "model_engine=megatron",
        "actor_rollout_ref.rollout.name=vllm",
        "distillation.enabled=true",
        "distillation.teacher_models.teacher_model.key=teacher",
        "distillation.teacher_models.teacher_model.model_path=teacher",
        "distillation.n_gpus_per_node=2",  # the teacher's default inference TP
        "distillation.nnodes=1",
        *(f"distillation.distillation_loss.{key}={'null' if value is None else value}" for key, value in entries),
    ]
    # main_ppo's config folder, without importing main_ppo (which starts ray's remote functions)
    config_dir = os.path.join(os.path.dirname(importlib.util.find_spec("verl.trainer.main_ppo").origin), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name="ppo_trainer", overrides=overrides)
    return omega_conf_to_dataclass(config.distillation)


def distillation_config(**loss_entries):
    """verl's DistillationConfig for these `distillation.distillation_loss` entries (e.g. loss_mode="k3"), through
    verl's Hydra config and `omega_conf_to_dataclass`, as verl's worker builds it; composed once per entries."""
    return _composed(tuple(sorted(loss_entries.items())))


def loss_function(actor_config, config):
    """verl's distillation loss as `ActorRolloutRefWorker` binds it for the actor."""
    from verl.trainer.distillation import distillation_ppo_loss

    return functools.partial(distillation_ppo_loss, config=actor_config, distillation_config=config)


def step_flags(config) -> dict:
    """The non-tensor entries verl's trainer sets on an actor update (`_update_actor`)."""
    loss = config.distillation_loss
    use_topk = loss.loss_settings.use_topk
    return {
        "distillation_use_topk": use_topk,
        "distillation_only": use_topk and not loss.use_task_rewards and not loss.use_policy_gradient,
    }


def teacher_values(next_ids: torch.Tensor, config, vocab_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A teacher's (int32 ids, log-probs) [..., k] for the positions of `next_ids` (the token each position
    predicts). Top-k (k = the config's topk): ids drawn from the whole vocabulary (every tensor-parallel shard),
    log-probs descending, some below -10, and on every third position the last entry repeats the first id (verl
    scores each entry). Estimators (k = 1): the next token's id, a log-prob near a tiny random student's."""
    generator = torch.Generator().manual_seed(seed + 17)
    shape = next_ids.shape
    if config.distillation_loss.loss_settings.use_topk:
        k = config.distillation_loss.topk
        ids = torch.randint(0, vocab_size, (*shape, k), generator=generator)
        ids[..., ::3, -1] = ids[..., ::3, 0]
        logits = 2.5 * torch.randn(*shape, k + 8, generator=generator)
        log_probs = torch.log_softmax(logits, dim=-1).sort(dim=-1, descending=True).values[..., :k]
    else:
        ids = next_ids.unsqueeze(-1)
        log_probs = -6.9 + 0.7 * torch.randn(*shape, 1, generator=generator)
    return ids.to(torch.int32), log_probs


def add_teacher(fields: dict[str, torch.Tensor], config, vocab_size: int, seed: int) -> None:
    """`teacher_values` as the trainer's padded `teacher_ids` / `teacher_logprobs` [batch, sequence, k] of the
    rollout `fields` (position t holding the teacher's distribution of token t+1, as verl's teacher returns prompt
    log-probs; pad id and 0 on padding)."""
    real = fields["attention_mask"].bool().unsqueeze(-1)
    ids, log_probs = teacher_values(torch.roll(fields["input_ids"], -1, dims=1), config, vocab_size, seed)
    fields["teacher_ids"] = torch.where(real, ids, PAD_TOKEN_ID).to(torch.int32)
    fields["teacher_logprobs"] = torch.where(real, log_probs, 0.0)


def nested_teacher(input_ids: torch.Tensor, config, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """`teacher_values` nested like `input_ids` (a batch already in verl's packed layout), on its device."""
    values, offsets = input_ids.values(), input_ids.offsets()
    next_ids = torch.roll(values.cpu(), -1)  # a sequence's last position predicts past it: any id will do
    ids, log_probs = teacher_values(next_ids, config, vocab_size, seed)
    return {
        "teacher_ids": torch.nested.nested_tensor_from_jagged(ids.to(values.device), offsets=offsets),
        "teacher_logprobs": torch.nested.nested_tensor_from_jagged(log_probs.to(values.device), offsets=offsets),
    }
