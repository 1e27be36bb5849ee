"""Synthetic GRPO rollouts in the layout verl's trainer hands its workers, with verl's own advantage function.

Why: a training-loop comparison must feed verl's engine what `RayPPOTrainer`
feeds it: left-padded prompts and right-padded responses (`prompts`,
`responses`, `input_ids`, `attention_mask`, `position_ids`, `response_mask`),
n responses per prompt sharing a uid, outcome rewards on each response's last
token, GRPO advantages from `verl.trainer.ppo.core_algos.compute_grpo_outcome_advantage`,
converted to the packed layout with `verl.workers.utils.padding.left_right_2_no_padding`.
Tokens, lengths and rewards are random from (seed, step), so every process
and every mode sees the same batch at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAD_TOKEN_ID = 0


@dataclass(frozen=True)
class RolloutShape:
    """How one step's batch looks: prompts per step, responses per prompt, length ranges (inclusive)."""

    prompts: int
    n: int
    prompt_lengths: tuple[int, int]
    response_lengths: tuple[int, int]

    def __post_init__(self):
        for name in ("prompt_lengths", "response_lengths"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"RolloutShape.{name}: expected 1 <= low <= high, got {(low, high)}")
        if self.prompts < 1 or self.n < 1:
            raise ValueError(f"RolloutShape.prompts and .n: expected >= 1, got {self.prompts}, {self.n}")

    @property
    def sequences(self) -> int:
        return self.prompts * self.n


def _lengths(generator, count, bounds):
    low, high = bounds
    return torch.randint(low, high + 1, (count,), generator=generator).tolist()


def rollout(shape: RolloutShape, vocab_size: int, seed: int, step: int) -> dict[str, torch.Tensor]:
    """One step's padded rollout plus GRPO advantages, as plain tensors (the trainer's DataProto fields)."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage  # verl loads in the worker processes only

    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    prompt_lens = [n for n in _lengths(generator, shape.prompts, shape.prompt_lengths) for _ in range(shape.n)]
    response_lens = _lengths(generator, shape.sequences, shape.response_lengths)
    max_prompt, max_response = max(prompt_lens), max(response_lens)
    prompts = torch.full((shape.sequences, max_prompt), PAD_TOKEN_ID, dtype=torch.long)
    responses = torch.full((shape.sequences, max_response), PAD_TOKEN_ID, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompts)
    response_mask = torch.zeros_like(responses)
    for group in range(shape.prompts):
        rows = range(group * shape.n, (group + 1) * shape.n)
        length = prompt_lens[rows[0]]
        tokens = torch.randint(1, vocab_size, (length,), generator=generator)
        for row in rows:  # the n responses of a group share their prompt (left-padded)
            prompts[row, max_prompt - length :] = tokens
            prompt_mask[row, max_prompt - length :] = 1
    for row, length in enumerate(response_lens):
        responses[row, :length] = torch.randint(1, vocab_size, (length,), generator=generator)
        response_mask[row, :length] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp_min(0)

    scores = torch.rand(shape.sequences, generator=generator)
    token_level_rewards = torch.zeros(shape.sequences, max_response)
    token_level_rewards[torch.arange(shape.sequences), torch.tensor(response_lens) - 1] = scores
    uid = np.array([f"prompt{group}" for group in range(shape.prompts) for _ in range(shape.n)], dtype=object)
    advantages, _ = compute_grpo_outcome_advantage(token_level_rewards, response_mask.float(), uid)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "advantages": advantages,
    }


def packed(fields: dict[str, torch.Tensor], temperature: float, **non_tensor):
    """A TensorDict in verl's packed (no-padding) layout, as the trainer builds it for a worker call."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch = dict(fields)
    batch["temperature"] = torch.full((fields["input_ids"].shape[0],), float(temperature))
    data = left_right_2_no_padding(tu.get_tensordict(batch))
    tu.assign_non_tensor(data, **non_tensor)
    return data
