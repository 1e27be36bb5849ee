"""Rollouts drawn from a megatron GPTModel itself with vLLM's top-k / top-p rule, as vLLM would return them.

Why: sampling replay is judged on rollouts whose `processed_logprobs` and kept sets come from the trained model's own
logits, exactly as a vLLM rollout with `SamplingMask` would hand them to verl; vLLM is not a dependency, and its
sampler needs a GPU. The rule, from vLLM's `apply_top_k_top_p_pytorch` (vllm/v1/sample/ops/topk_topp_sampler.py):
logits divided by the temperature and sorted ascending; top-k masks the values strictly below the k-th largest (ties
at the k-th value stay); top-p, on the top-k-masked row: softmax, cumulative sum in ascending order, mask where it is
<= 1 - p, the largest always kept. Computed in fp64 from the model's fp32 logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def vllm_keep_mask(logits: torch.Tensor, temperature: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """bool [N, V]: the tokens vLLM's top-k / top-p keeps for each row of logits [N, V] (temperature [N])."""
    z = logits.double() / temperature.double().unsqueeze(1)
    z_sorted, order = z.sort(dim=1, descending=False)
    if top_k > 0:
        kth = z_sorted[:, z.shape[1] - top_k].unsqueeze(1)
        z_sorted = z_sorted.masked_fill(z_sorted < kth, float("-inf"))
    if top_p < 1.0:
        cumulative = z_sorted.softmax(dim=1).cumsum(dim=1)
        drop = cumulative <= 1 - top_p
        drop[:, -1] = False
        z_sorted = z_sorted.masked_fill(drop, float("-inf"))
    kept_sorted = torch.isfinite(z_sorted)
    return torch.zeros_like(kept_sorted).scatter(1, order, kept_sorted)


@dataclass(frozen=True)
class Truncation:
    """The rollout's sampling (verl's rollout.temperature, top_k, top_p)."""

    temperature: float
    top_k: int
    top_p: float


@dataclass
class SampledResponses:
    """Responses [B, R] with, per token: vLLM's processed log-prob (over the kept set), the kept set as ids
    [B, R, k_max] (-1 padding, verl's `rollout_kept_ids` layout), its full-vocabulary mass and the full-vocabulary
    entropy of the policy at the temperature."""

    responses: torch.Tensor
    log_probs: torch.Tensor
    kept_ids: torch.Tensor
    kept_mass: torch.Tensor
    entropy: torch.Tensor


def position_logits(
    *, hidden_states, output_layer, output_weight=None, config=None, context: int, **_later_arguments
) -> torch.Tensor:
    """A GPTModel `output_processor`: fp32 logits [b, V] at sequence position `context` (the processor's context),
    every column on every tensor-parallel rank (the hidden states gathered first under sequence parallelism, the
    vocabulary shards after).

    fp32 from the model's own hidden states and output weight, so the rollout's log-probs differ from the trainer's
    by the trainer's arithmetic only, not by a bf16 rounding of the logits."""
    from megatron.core import parallel_state, tensor_parallel

    if config is not None and config.sequence_parallel:
        hidden_states = tensor_parallel.gather_from_sequence_parallel_region(hidden_states)
    weight = output_layer.weight if output_weight is None else output_weight
    logits = hidden_states[context].float() @ weight.float().t()
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
    return logits


def sample_responses(
    gpt, prompts: torch.Tensor, length: int, truncation: Truncation, generator: torch.Generator
) -> SampledResponses:
    """Draw `length` tokens after each prompt (prompts [B, P], no padding) from `gpt` (a megatron GPTModel) by
    vLLM's rule, recomputing the whole prefix each token (tiny models: no KV cache needed). Under tensor parallelism
    every rank calls it with the same prompts and generator state and draws the same tokens.

    The class's own forward is called with the output processor above, so the draw reads the same logits whether
    or not verl has patched the instance's forward (legacy mode)."""
    from megatron.core import parallel_state

    sequences = prompts
    temperature = torch.full((prompts.shape[0],), truncation.temperature, device=prompts.device)
    # sequence parallelism splits the sequence over the ranks: right padding (causal: no position reads it) evens it
    multiple = parallel_state.get_tensor_model_parallel_world_size() if gpt.config.sequence_parallel else 1
    drawn, log_probs, kept, kept_mass, entropy = [], [], [], [], []
    with torch.no_grad():
        for _ in range(length):
            n = sequences.shape[1]
            padded = torch.nn.functional.pad(sequences, (0, -n % multiple))
            width = padded.shape[1]
            positions = torch.arange(width, device=prompts.device).expand_as(padded)
            causal = torch.ones(width, width, dtype=torch.bool, device=prompts.device).triu(1)[None, None]  # masked
            logits = type(gpt).forward(
                gpt, input_ids=padded, position_ids=positions, attention_mask=causal,
                output_processor=position_logits, output_processor_context=n - 1,
            )  # fmt: skip
            keep = vllm_keep_mask(logits, temperature, truncation.top_k, truncation.top_p)
            z = logits.double() / truncation.temperature
            processed = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=1)
            token = torch.multinomial(processed.exp(), 1, generator=generator)
            full = torch.log_softmax(z, dim=1)
            drawn.append(token[:, 0])
            log_probs.append(processed.gather(1, token)[:, 0].float())
            kept.append(keep)
            kept_mass.append(full.exp().masked_fill(~keep, 0.0).sum(dim=1).float())
            entropy.append(-(full.exp() * full).sum(dim=1).float())
            sequences = torch.cat([sequences, token], dim=1)
    keep = torch.stack(kept, dim=1)  # [B, R, V]
    width = int(keep.sum(dim=2).max())
    # the kept ids first in each row, ascending, then -1: a stable sort of "not kept" puts the kept columns in front
    order = (~keep).to(torch.int8).sort(dim=2, stable=True).indices[..., :width]
    kept_ids = torch.where(keep.gather(2, order), order, -1)
    return SampledResponses(
        responses=torch.stack(drawn, dim=1),
        log_probs=torch.stack(log_probs, dim=1),
        kept_ids=kept_ids,
        kept_mass=torch.stack(kept_mass, dim=1),
        entropy=torch.stack(entropy, dim=1),
    )
