"""Exact on-policy through verl's real Megatron engine on the CPU: the same sequences in other packings give the same
hook-mode log-prob bits, and the first on-policy step with the loss inside the op reports ppo_kl and pg_clipfrac 0.

verl computes the old log-probs (`infer_batch`, `log_prob_micro_batch_size_per_gpu`) and the update's forward
(`train_batch`, `ppo_micro_batch_size_per_gpu`) in different micro-batches, so the PPO ratio is exactly 1 only when a
sequence's log-probs do not depend on the sequences packed beside it. The output layer guarantees that (the op's batch
invariance); the decoder must give identical hidden states too. Megatron's own batch-invariant decoder needs
Transformer Engine, so here the decoder's output is held fixed another way: every sequence is a whole number of
8-token blocks, and on the CPU every product of the tiny local-spec model then runs in whole blocks of MKL's kernels
(tests/test_batch_invariance.py: rows of a product come out the same in any such block), so a sequence's hidden states
do not depend on its packing. The engine is verl's (`MegatronEngineWithLMHead.__init__`, `initialize()`,
`infer_batch`, `train_batch`); the model build is the named local-spec stand-in (stand_ins/local_spec_build.py).
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from verl_fused_hook_harness.support.distributed import run_in_processes
from verl_fused_hook_harness.support.hf_model import TINY_QWEN2

TEMPERATURE = 0.7
# Sequences of whole 8-token blocks (the decoder's products in whole blocks), responses of any length (the output
# layer's scored rows are not whole blocks: the op's own invariance is what keeps their bits)
PROMPT_LENGTHS = (5, 13, 9, 20, 3, 7)
RESPONSE_LENGTHS = (11, 3, 15, 4, 13, 25)


def _fields(vocab_size: int, order: list[int]) -> dict[str, torch.Tensor]:
    """A left-padded / right-padded rollout of the sequences in `order` (the trainer's DataProto fields)."""
    from verl_fused_hook_harness.support.grpo_batches import PAD_TOKEN_ID

    generator = torch.Generator().manual_seed(3)
    tokens = [
        (
            torch.randint(1, vocab_size, (p,), generator=generator),
            torch.randint(1, vocab_size, (r,), generator=generator),
        )
        for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)
    ]
    advantages = torch.randn(len(tokens), generator=generator)
    count, max_prompt, max_response = len(order), max(PROMPT_LENGTHS), max(RESPONSE_LENGTHS)
    prompts = torch.full((count, max_prompt), PAD_TOKEN_ID)
    responses = torch.full((count, max_response), PAD_TOKEN_ID)
    prompt_mask, response_mask = torch.zeros_like(prompts), torch.zeros_like(responses)
    for row, sequence in enumerate(order):
        prompt, response = tokens[sequence]
        prompts[row, max_prompt - prompt.numel() :], prompt_mask[row, max_prompt - prompt.numel() :] = prompt, 1
        responses[row, : response.numel()], response_mask[row, : response.numel()] = response, 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp_min(0),
        "response_mask": response_mask,
        "advantages": advantages[order].unsqueeze(1) * response_mask,
    }


def _engine_keys(micro_batch: int) -> dict:
    """The non-tensor entries verl's TrainingWorker adds to every batch."""
    return dict(
        use_remove_padding=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=micro_batch, use_fused_kernels=True
    )


def _old_log_probs(engine, fields, micro_batch: int) -> torch.Tensor:
    """Forward-only log-probs as the trainer computes old log-probs, padded [batch, response]."""
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_fused_hook_harness.support.grpo_batches import packed

    data = packed(fields, TEMPERATURE, calculate_entropy=True, compute_loss=False, **_engine_keys(micro_batch))
    with engine.eval_mode():
        output = engine.infer_batch(data, loss_function=None)
    return no_padding_2_padding(output["model_output"]["log_probs"], data).float().cpu()


def _ppo_loss(micro_batch: int, sequences: int):
    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    config = McoreActorConfig(
        ppo_mini_batch_size=sequences,
        ppo_micro_batch_size_per_gpu=micro_batch,
        use_dynamic_bsz=False,
        entropy_coeff=0.01,
        loss_agg_mode="token-mean",
        rollout_n=1,
    )
    return functools.partial(ppo_loss, config=config)


def _on_policy_worker(rank: int, world_size: int, dtype: str) -> dict:
    from verl_fused_hook.switch import ENV_VAR
    from verl_fused_hook.verl_integration.model_plan import counts_of, plan_of
    from verl_fused_hook_harness.commands.train.runs import metric_values
    from verl_fused_hook_harness.stand_ins.cuda_on_cpu import cuda_names_on_cpu
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel
    from verl_fused_hook_harness.support.grpo_batches import packed
    from verl_fused_hook_harness.support.train_engine import EngineSetup, build_engine
    from verl_fused_hook_harness.support.verl_engine import prepare_verl_process

    prepare_verl_process(rank)
    init_model_parallel(1, seed=5)
    os.environ[ENV_VAR] = "1"
    sequences = len(PROMPT_LENGTHS)
    setup = EngineSetup(
        hf_path=str(TINY_QWEN2),
        tp=1,
        dtype=dtype,
        seed=5,
        micro_batch_size=2,
        total_steps=2,
        lr=1e-4,
        offload=False,
        fused_kernel_options={"output_processor_fused_loss": True, "output_processor_batch_invariant": True},
    )
    with cuda_names_on_cpu():
        actor = build_engine(setup)
        vocab_size = actor.model_config.hf_config.vocab_size
        in_order = list(range(sequences))
        fields = _fields(vocab_size, in_order)
        per_packing = {micro: _old_log_probs(actor, fields, micro) for micro in (1, 2, 6)}
        shuffled = [4, 1, 5, 0, 3, 2]
        reordered = _old_log_probs(actor, _fields(vocab_size, shuffled), 3)
        back = torch.empty_like(reordered)
        back[torch.tensor(shuffled)] = reordered
        fields["old_log_probs"] = per_packing[2]
        data = packed(fields, TEMPERATURE, calculate_entropy=True, global_batch_size=sequences, **_engine_keys(3))
        fused_before = sum(counts_of(model).fused_loss_forwards for model in actor.module)
        with actor.train_mode():
            output = actor.train_batch(data, loss_function=_ppo_loss(3, sequences))
        fused = sum(counts_of(model).fused_loss_forwards for model in actor.module) - fused_before
    metrics = output["metrics"]
    return {
        "same_bits": {micro: bool(torch.equal(values, per_packing[2])) for micro, values in per_packing.items()},
        "reordered_same_bits": bool(torch.equal(back, per_packing[2])),
        "response_tokens": int(fields["response_mask"].sum()),
        "ppo_kl": metric_values(metrics["actor/ppo_kl"]),
        "pg_clipfrac": metric_values(metrics["actor/pg_clipfrac"]),
        "fused_loss_forwards": fused,
        "batch_invariant": [plan_of(model).batch_invariant for model in actor.module],
    }


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_first_on_policy_step_has_ratio_exactly_one(dtype):
    result = run_in_processes(_on_policy_worker, 1, dtype)[0]
    # log-probs per sequence: micro-batches of 1, 2 and all 6 sequences, and reordered in micro-batches of 3
    assert result["same_bits"] == {1: True, 2: True, 6: True} and result["reordered_same_bits"], result
    # the update (micro-batches of 3, loss inside the op) recomputes exactly the old log-probs (micro-batches of 2)
    assert result["fused_loss_forwards"] == 2, result
    assert result["batch_invariant"] == [True], result  # the config entry reached the model's plan (the ops' flag)
    assert result["ppo_kl"] and all(value == 0.0 for value in result["ppo_kl"]), result
    assert result["pg_clipfrac"] and all(value == 0.0 for value in result["pg_clipfrac"]), result
