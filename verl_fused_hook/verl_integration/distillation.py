"""verl's on-policy distillation in hook mode: the teacher top-k's per-token forward KL from hidden states.

Why: for a step whose batch says `distillation_use_topk`, verl's unfused path hands the [tokens, vocab / TP]
logits to its loss function (`distillation_ppo_loss(student_logits=...)`, i.e. `_VocabParallelKLDivergence`),
which returns per-token `distillation_losses`, `student_mass`, `teacher_mass`, `overlap_count` and
`overlap_token_advantage`; verl's final loss (`distillation_ppo_loss(model_output=...)`) reads them from the
model output. Its fused path (and hook mode before this module) returns log-probs and entropy only, so the
final loss stops with `KeyError: 'distillation_losses'`. Here the same five outputs come from the op
`token_log_probs` (the student's log-probs at the teacher's k ids and its own top-k, from hidden states) in the
model's packed or padded layout, so verl's final loss runs unchanged.

The math is verl 0.9.1's (trainer/distillation/megatron/losses.py), per token, k teacher entries i:
    t_i = clamp_min(teacher log-prob_i, c), q_i = exp(t_i)               (c: log_prob_min_clamp, optional)
    s_i = log p(id_i) if log p(id_i) > c else c                          (strict >: no gradient at or below c)
    loss = sum_i q_i (t_i - s_i),  teacher_mass = sum_i q_i,  student_mass = sum_i exp(s_i)
    overlap: entries whose id is among the student's own top-k (k = the teacher's k), counted with repeats;
    overlap_token_advantage = mean over those entries of -q_i (t_i - s_i), 0 where there are none.
Autograd of `loss` through `token_log_probs` gives verl's gradient m_A p - q 1[A] (A: the entries above the
clamp, m_A their teacher mass): the op adds the dense part (sum of the ids' coefficients) and the sparse part.

The teacher fields are checked before the model runs (`check_teacher_fields`): a ValueError names the field
for ids outside the student's vocabulary, shapes that disagree with input_ids or each other, non-finite
log-probs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# The model outputs verl's logits processor adds for a top-k distillation step (verl's final loss reads them).
TOPK_OUTPUT_KEYS = ("distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage")
TEACHER_IDS, TEACHER_LOG_PROBS = "teacher_ids", "teacher_logprobs"  # verl's batch fields


@dataclass(frozen=True)
class TopKDistillation:
    """What a top-k distillation step needs in the engine forward: the teacher's top-k (nested like input_ids,
    plus a last dim of k), verl's `log_prob_min_clamp`, and whether the step skips the label log-probs
    (verl's `distillation_only`)."""

    teacher_ids: torch.Tensor
    teacher_log_probs: torch.Tensor
    log_prob_min_clamp: float | None
    distillation_only: bool

    @property
    def top_k(self) -> int:
        return self.teacher_ids.values().shape[-1]


def distillation_config_of(loss_function):
    """The DistillationConfig bound to `loss_function` when it is verl's `distillation_ppo_loss` (as verl's worker
    binds it: `partial(distillation_ppo_loss, config=..., distillation_config=...)`), else None."""
    from verl.trainer.distillation.losses import distillation_ppo_loss

    if isinstance(loss_function, functools.partial) and loss_function.func is distillation_ppo_loss:
        return loss_function.keywords.get("distillation_config")
    return None


def topk_distillation(batch, loss_function, vocab_size: int, distillation_only: bool) -> TopKDistillation:
    """The step's TopKDistillation, its teacher fields checked; ValueError naming what is wrong."""
    config = distillation_config_of(loss_function)
    if config is None:
        name = getattr(getattr(loss_function, "func", loss_function), "__name__", repr(loss_function))
        raise ValueError(
            f"distillation_use_topk: hook mode computes verl's top-k distillation outputs for "
            f"distillation_ppo_loss (bound to a distillation_config, as verl's worker binds it), got loss {name}"
        )
    ids, log_probs = check_teacher_fields(batch, vocab_size, ids_read=True)
    return TopKDistillation(ids, log_probs, config.distillation_loss.log_prob_min_clamp, bool(distillation_only))


def check_teacher_fields(batch, vocab_size: int, *, ids_read: bool, entries: int | None = None):
    """(teacher_ids or None, teacher_logprobs) of `batch`, checked where the loss reads them: present, nested like
    input_ids with one more dim, ids and log-probs alike (and `entries` per token when given), ids integers in
    [0, vocab_size) when `ids_read`, log-probs finite. One host read. ValueError naming the field."""
    input_ids = batch["input_ids"]
    keys = batch.keys()
    fields = (TEACHER_IDS, TEACHER_LOG_PROBS) if ids_read else (TEACHER_LOG_PROBS,)
    for field in fields:
        if field not in keys:
            raise ValueError(f"{field}: the distillation loss reads it, but the batch has no {field}")
    log_probs = _checked_shape(TEACHER_LOG_PROBS, batch[TEACHER_LOG_PROBS], input_ids, entries)
    ids = None
    if TEACHER_IDS in keys:
        ids = _checked_shape(TEACHER_IDS, batch[TEACHER_IDS], input_ids, log_probs.values().shape[-1])
        if ids.values().is_floating_point() or ids.values().is_complex() or ids.values().dtype == torch.bool:
            raise ValueError(f"{TEACHER_IDS}: must hold integer token ids, got {ids.values().dtype}")
    if not log_probs.values().is_floating_point():
        raise ValueError(f"{TEACHER_LOG_PROBS}: must be floating point, got {log_probs.values().dtype}")
    values = log_probs.values()
    flags = [~torch.isfinite(values).all()]
    if ids_read:
        flags.append(((ids.values() < 0) | (ids.values() >= vocab_size)).any())
    bad = torch.stack(flags).tolist()
    if bad[0]:
        found = values[~torch.isfinite(values)][0].item()
        raise ValueError(f"{TEACHER_LOG_PROBS}: every teacher log-prob must be finite, found {found}")
    if ids_read and bad[1]:
        found = ids.values()[(ids.values() < 0) | (ids.values() >= vocab_size)][0].item()
        raise ValueError(
            f"{TEACHER_IDS}: ids must lie in [0, {vocab_size}) (the student's vocabulary, its output layer's rows), "
            f"found {found}"
        )
    return (ids if ids_read else None), log_probs


def _checked_shape(field: str, value, input_ids: torch.Tensor, entries: int | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or not value.is_nested:
        raise ValueError(
            f"{field}: must be a nested tensor shaped like input_ids plus a last dim [batch, tokens, k] (what "
            f"verl's left_right_2_no_padding makes of the trainer's padded field), got {type(value).__name__}"
            + ("" if not isinstance(value, torch.Tensor) else f" {tuple(value.shape)}")
        )
    offsets = value.offsets().to(input_ids.offsets().device)
    if value.values().dim() != 2 or not torch.equal(offsets, input_ids.offsets()):
        lengths, want = value.offsets().diff().tolist(), input_ids.offsets().diff().tolist()
        raise ValueError(
            f"{field}: must hold one row of k entries per token of input_ids (sequence lengths {want}), got "
            f"sequence lengths {lengths} and rows of shape {tuple(value.values().shape[1:])}"
        )
    if entries is not None and value.values().shape[-1] != entries:
        raise ValueError(f"{field}: must hold k={entries} values per token, got k={value.values().shape[-1]}")
    return value


def forward_kl_topk(
    token_log_probs: torch.Tensor,
    top_ids: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    log_prob_min_clamp: float | None,
    computed: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """verl's five top-k distillation outputs per token (module docstring), in the model's [b, s] layout.

    token_log_probs [b, s, k]: the student's log-probs at teacher_ids (differentiable); top_ids [b, s, k]: the
    student's own top-k; teacher_* [b, s, k]; computed: bool [b, s], the rows the op computed (None: every row);
    the others hold 0 in every output, as the op's own outputs do."""
    teacher = teacher_log_probs
    if log_prob_min_clamp is not None:
        teacher = teacher.clamp_min(log_prob_min_clamp)  # in the teacher's dtype, then fp32, as verl
    teacher = teacher.float()
    q = teacher.exp()
    student = token_log_probs
    if log_prob_min_clamp is not None:
        floor = torch.full_like(student, log_prob_min_clamp)
        student = torch.where(student > log_prob_min_clamp, student, floor)
    entry_kl = q * (teacher - student)
    overlap = _among(teacher_ids.long(), top_ids)
    overlap_count = overlap.sum(dim=-1)
    advantage = (-entry_kl.detach() * overlap).sum(dim=-1) / overlap_count.clamp_min(1)
    outputs = {
        "distillation_losses": entry_kl.sum(dim=-1),
        "student_mass": student.detach().exp().sum(dim=-1),
        "teacher_mass": q.sum(dim=-1),
        "overlap_count": overlap_count,
        "overlap_token_advantage": torch.where(overlap_count > 0, advantage, torch.zeros_like(advantage)),
    }
    if computed is None:
        return outputs
    return {key: torch.where(computed, value, torch.zeros_like(value)) for key, value in outputs.items()}


def _among(ids: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """bool shaped like ids: whether each id is one of its row's candidates (last dims; memory O(k), not O(k^2))."""
    ordered = candidates.sort(dim=-1).values.contiguous()
    position = torch.searchsorted(ordered, ids.contiguous()).clamp_max(ordered.shape[-1] - 1)
    return ordered.gather(-1, position) == ids
