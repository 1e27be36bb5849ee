"""The micro-batches `ab-parity` and `e2e-bench` feed verl's engine, and the GRPO-style loss they back-propagate.

Why here: the A/B scenarios, the e2e benchmarks and the MTP runs must hand verl's engine the same layout
(nested jagged `input_ids`/`prompts`/`responses`, what `forward_step` also needs: a loss mask on the response
tokens, per-sequence temperatures) and read the same rows back (each response token's prediction), so that
their numbers compare. Tokens, lengths, advantages and old-log-prob offsets come from a seed: every process
and every mode sees the same batch. verl and the runtime's megatron-dependent parts load on first use
(`import verl` starts ray).
"""

from __future__ import annotations

import torch

TEMPERATURE = 0.7
CLIP = 0.2
ENTROPY_COEF = 0.01
# The A/B batch: four sequences of fixed lengths.
PROMPT_LENS = (5, 9, 3, 7)
RESPONSE_LENS = (8, 4, 11, 6)
# The e2e batch: this many sequences of mixed lengths per micro-batch, half prompt, half response.
SEQUENCES_PER_BATCH = 8


def jagged(parts, device=None) -> torch.Tensor:
    """A jagged nested tensor of `parts` (moved to `device` when given), as verl's batches hold sequences."""
    return torch.nested.as_nested_tensor([p if device is None else p.to(device) for p in parts], layout=torch.jagged)


def ab_rollout(vocab_size: int, seed: int):
    """The A/B batch: prompts, responses, per-sequence advantages and old-log-prob offsets."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab_size, (n,), generator=generator) for n in PROMPT_LENS]
    responses = [torch.randint(0, vocab_size, (n,), generator=generator) for n in RESPONSE_LENS]
    advantages = torch.randn(len(PROMPT_LENS), generator=generator)
    old_offset = 0.05 * torch.randn(len(PROMPT_LENS), max(RESPONSE_LENS), generator=generator)
    return prompts, responses, advantages, old_offset


def sequence_lengths(total: int, count: int, seed: int) -> list[int]:
    """`count` mixed lengths (ratio up to 4:1) summing to `total`, each even and >= 4."""
    generator = torch.Generator().manual_seed(seed + total)
    weights = 0.5 + 1.5 * torch.rand(count, generator=generator)
    lengths = [max(4, 2 * int(total * w / weights.sum() / 2)) for w in weights.tolist()]
    lengths[-1] += total - sum(lengths)
    if lengths[-1] < 4:
        raise ValueError(f"cannot split {total} tokens into {count} sequences of >= 4 tokens")
    return lengths


def e2e_rollout(vocab_size: int, total: int, device: str, seed: int):
    """The e2e batch of `total` tokens: (input_ids, data, advantages, old_offset, sequence lengths), where
    `data` holds nested input_ids/prompts/responses (verl's THD layout)."""
    generator = torch.Generator().manual_seed(seed + 7 * total)
    lengths = sequence_lengths(total, SEQUENCES_PER_BATCH, seed)
    prompts = [torch.randint(0, vocab_size, (n // 2,), generator=generator) for n in lengths]
    responses = [torch.randint(0, vocab_size, (n - n // 2,), generator=generator) for n in lengths]
    advantages = torch.randn(len(lengths), generator=generator)
    old_offset = 0.05 * torch.randn(len(lengths), max(r.numel() for r in responses), generator=generator)
    input_ids, data = engine_inputs(prompts, responses, device)
    return input_ids, data, advantages.to(device), old_offset.to(device), lengths


def engine_inputs(prompts, responses, device: str):
    """(input_ids, data): nested prompt+response ids and verl's TensorDict of input_ids, prompts, responses."""
    from verl.utils import tensordict_utils as tu

    input_ids = jagged([torch.cat(pair) for pair in zip(prompts, responses)], device)
    data = tu.get_tensordict(
        {"input_ids": input_ids, "prompts": jagged(prompts, device), "responses": jagged(responses, device)}
    )
    return input_ids, data


def forward_step_batch(input_ids, prompts, responses, temperature: float, *, extra_fields=None, **non_tensor):
    """What verl's `forward_step` reads from a micro-batch, as verl's TensorDict: ids, prompts/responses, a loss
    mask on the response tokens, per-sequence temperatures, `extra_fields` (e.g. what ppo_loss reads), and
    entropy requested besides the `non_tensor` entries."""
    from verl.utils import tensordict_utils as tu

    loss_mask = [
        torch.cat([torch.zeros_like(p), torch.ones_like(r)]) for p, r in zip(prompts.unbind(), responses.unbind())
    ]
    fields = {
        "input_ids": input_ids,
        "prompts": prompts,
        "responses": responses,
        "loss_mask": jagged(loss_mask),
        "temperature": torch.full((input_ids.shape[0],), temperature, device=input_ids.device),
        **(extra_fields or {}),
    }
    return tu.get_tensordict(fields, non_tensor_dict={"calculate_entropy": True, **non_tensor})


def grpo_loss(log_probs, entropy, data, advantages, old_offset):
    """Clipped policy-gradient loss minus an entropy bonus, over the response rows verl reads."""
    from verl.workers.utils.padding import no_padding_2_padding

    response_log_probs = no_padding_2_padding(log_probs, data)
    response_entropy = no_padding_2_padding(entropy, data)
    lengths = data["responses"].offsets().diff().to(response_log_probs.device)
    positions = torch.arange(response_log_probs.shape[1], device=response_log_probs.device)
    mask = positions.unsqueeze(0) < lengths.unsqueeze(1)
    old = response_log_probs.detach() + old_offset[:, : response_log_probs.shape[1]].to(mask.device)
    ratio = torch.exp(response_log_probs - old)
    adv = advantages.to(mask.device).unsqueeze(1)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    count = mask.sum()
    return (per_token * mask).sum() / count - ENTROPY_COEF * (response_entropy * mask).sum() / count


def response_rows(data):
    """Jagged bool shaped like data["input_ids"]: True on the rows the loss reads (each response token's
    prediction), the rows hook mode's score mask computes; None when the lengths do not describe input_ids."""
    from verl_fused_hook.verl_integration.forward_step import response_score_rows

    return response_score_rows(data, None)


def response_values(values: torch.Tensor, data) -> torch.Tensor:
    """The values (nested like input_ids) on the rows the loss reads, flattened."""
    return values.values()[response_rows(data).values()]


def synthetic_kept_sets(responses: torch.Tensor, width: int, vocab_size: int, seed: int) -> torch.Tensor:
    """A stand-in for the rollout's `rollout_kept_ids` of `responses` (nested [batch, response_len]): int64
    [batch, longest response, width], -1 padding. Each token's set holds the token first, then a uniform 0 to
    width - 1 other ids (as top-p within top_k=width varies a set's size), spread over the vocabulary at random
    gaps: neighbouring tokens' sets share few ids (a real rollout's share most), near the widest union a chunk of rows
    can have.

    Why synthetic: the e2e batch's tokens are random, not sampled from the model, so no rollout's sets exist for them;
    these have the shape and sizes of real ones and hold their label, as the op requires."""
    if not 1 <= width <= vocab_size:
        raise ValueError(f"kept sets of width {width}: expected 1 <= width <= vocab_size={vocab_size}")
    generator = torch.Generator().manual_seed(seed)
    labels = responses.values().cpu().long()
    sizes = torch.randint(1, width + 1, (labels.numel(), 1), generator=generator)
    spacing = (vocab_size - 1) // max(width - 1, 1)  # (width - 1) gaps of at most this stay below the vocabulary
    gaps = torch.randint(1, spacing + 1, (labels.numel(), width - 1), generator=generator)
    others = (labels.unsqueeze(1) + gaps.cumsum(dim=1)) % vocab_size  # distinct: offsets rise within [1, vocab)
    sets = torch.cat([labels.unsqueeze(1), others], dim=1)
    sets = torch.where(torch.arange(width) < sizes, sets, -1)
    offsets = responses.offsets().cpu()
    lengths = offsets.diff()
    padded = torch.full((lengths.numel(), int(lengths.max()), width), -1, dtype=torch.long)
    sample = torch.arange(lengths.numel()).repeat_interleave(lengths)
    padded[sample, torch.arange(labels.numel()) - offsets[sample]] = sets
    return padded.to(responses.device)
