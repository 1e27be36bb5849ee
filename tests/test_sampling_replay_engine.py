"""Sampling replay through verl's real Megatron engine on the CPU (issue 54 item 3).

A rollout is drawn token by token from the reference sampler (vLLM's top-k / top-p rule in fp64, `replay_reference`)
on megatron's own logits of the engine's model, with rollout.top_k=50, top_p=0.9: its `processed_logprobs` are
renormalized over each token's kept set, and those sets are what vLLM's mask replay returns. The engine's
old-log-prob pass then gives, per response token:
- with `output_processor_sampling_replay=true`, sets computed in the trainer: pi_old / pi_rollout = 1 within fp32
  numerics; with the rollout's sets in the batch (`rollout_kept_ids`): the same;
- with replay off: pi_old / pi_rollout = the kept set's full-vocabulary mass (the bias replay removes);
and a GRPO update with old_log_probs = the rollout's (bypass_mode) has ppo_kl 0 within numerics with replay.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch

from verl_fused_hook_harness.support.distributed import run_in_processes
from verl_fused_hook_harness.support.hf_model import TINY_QWEN2
from verl_fused_hook_harness.support.truncated_sampling import vllm_keep_mask

TOP_K, TOP_P, TEMPERATURE = 50, 0.9, 0.7
PROMPT_LENGTHS = (5, 9, 3, 7)
RESPONSE_LENGTHS = (6, 3, 8, 5)
# fp32 logits of one model through two paths (megatron's output layer, the op), exp'd; measured 4.8e-7
RATIO_TOLERANCE = 2e-6
# learning rate of the carry test: two steps move the tiny model enough that some kept set changes
CARRY_LR = 5e-2


def _replay_engine(thd: bool, lr: float, options: dict):
    """A tiny Qwen2 actor engine built with `options` under the rollout's top_k / top_p (inside cuda_names_on_cpu),
    its GPTModel and a rollout drawn on it by the reference sampler."""
    from verl_fused_hook.probe import unwrap_to_gpt
    from verl_fused_hook.verl_integration.sampling_replay import RolloutSampling, rollout_sampling
    from verl_fused_hook_harness.support.train_engine import EngineSetup, build_engine

    setup = EngineSetup(
        hf_path=str(TINY_QWEN2), tp=1, dtype="float32", seed=5, micro_batch_size=2, total_steps=2, lr=lr,
        offload=False, fused_kernel_options=options, use_remove_padding=thd,
    )  # fmt: skip
    with rollout_sampling(RolloutSampling(top_k=TOP_K, top_p=TOP_P)):
        actor = build_engine(setup)
    (model,) = actor.module
    return actor, model, _sample_rollout(unwrap_to_gpt(model), actor.model_config.hf_config.vocab_size)


def _sample_rollout(gpt, vocab_size: int) -> dict[str, torch.Tensor]:
    """verl's padded rollout fields, the responses drawn with vLLM's rule on megatron's own logits, plus the
    rollout's log-probs, kept sets [bs, response_len, k] (-1 padding) and each token's kept mass."""
    from verl_fused_hook_harness.support.grpo_batches import PAD_TOKEN_ID

    generator = torch.Generator().manual_seed(7)
    count, max_prompt, max_response = len(PROMPT_LENGTHS), max(PROMPT_LENGTHS), max(RESPONSE_LENGTHS)
    prompts = torch.full((count, max_prompt), PAD_TOKEN_ID)
    responses = torch.full((count, max_response), PAD_TOKEN_ID)
    prompt_mask, response_mask = torch.zeros_like(prompts), torch.zeros_like(responses)
    log_probs, kept_mass = torch.zeros(count, max_response), torch.ones(count, max_response)
    sets = [[None] * max_response for _ in range(count)]
    for row, (p, r) in enumerate(zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)):
        sequence = torch.randint(1, vocab_size, (p,), generator=generator)
        for j in range(r):
            n = sequence.numel()
            causal = torch.ones(n, n, dtype=torch.bool).triu(1)[None, None]  # True: masked
            with torch.no_grad():
                logits = gpt(input_ids=sequence[None], position_ids=torch.arange(n)[None], attention_mask=causal)
            z = logits[0, -1].double()
            keep = vllm_keep_mask(z[None], torch.tensor([TEMPERATURE]), TOP_K, TOP_P)[0]
            processed = torch.log_softmax((z / TEMPERATURE).masked_fill(~keep, float("-inf")), dim=0)
            token = torch.multinomial(processed.exp(), 1, generator=generator)
            log_probs[row, j] = processed[token].float()
            kept_mass[row, j] = torch.softmax(z / TEMPERATURE, dim=0)[keep].sum().float()
            sets[row][j] = keep.nonzero().flatten()
            sequence = torch.cat([sequence, token])
        prompts[row, max_prompt - p :], prompt_mask[row, max_prompt - p :] = sequence[:p], 1
        responses[row, :r], response_mask[row, :r] = sequence[p:], 1
    width = max(s.numel() for row in sets for s in row if s is not None)
    kept = torch.full((count, max_response, width), -1)
    for row, r in enumerate(RESPONSE_LENGTHS):
        for j in range(r):
            kept[row, j, : sets[row][j].numel()] = sets[row][j]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    generator.manual_seed(11)
    return {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp_min(0),
        "response_mask": response_mask,
        "advantages": torch.randn(count, 1, generator=generator) * response_mask,
        "rollout_log_probs": log_probs,
        "rollout_kept_ids": kept,
        "kept_mass": kept_mass,
    }


def _engine_keys(micro_batch: int, remove_padding: bool) -> dict:
    return dict(
        use_remove_padding=remove_padding,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch,
        use_fused_kernels=True,
    )


def _old_log_probs(engine, fields, remove_padding: bool) -> torch.Tensor:
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_fused_hook_harness.support.grpo_batches import packed

    data = packed(fields, TEMPERATURE, calculate_entropy=True, compute_loss=False, **_engine_keys(2, remove_padding))
    with engine.eval_mode():
        output = engine.infer_batch(data, loss_function=None)
    return no_padding_2_padding(output["model_output"]["log_probs"], data).float().cpu()


def _ppo_loss(sequences: int):
    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    config = McoreActorConfig(
        ppo_mini_batch_size=sequences,
        ppo_micro_batch_size_per_gpu=2,
        use_dynamic_bsz=False,
        loss_agg_mode="token-mean",
        rollout_n=1,
    )
    return functools.partial(ppo_loss, config=config)


def _replay_worker(rank: int, world_size: int, layout: str) -> dict:
    from verl_fused_hook.switch import ENV_VAR
    from verl_fused_hook.verl_integration.model_plan import plan_of, set_plan
    from verl_fused_hook_harness.commands.train.runs import metric_values
    from verl_fused_hook_harness.stand_ins.cuda_on_cpu import cuda_names_on_cpu
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel
    from verl_fused_hook_harness.support.grpo_batches import packed
    from verl_fused_hook_harness.support.verl_engine import prepare_verl_process

    thd = layout == "thd"
    prepare_verl_process(rank)
    init_model_parallel(1, seed=5)
    os.environ[ENV_VAR] = "1"
    with cuda_names_on_cpu():
        actor, model, fields = _replay_engine(thd, 1e-4, {"output_processor_sampling_replay": True})
        plan = plan_of(model)
        mask = fields["response_mask"].bool()
        given = {key: value for key, value in fields.items() if key != "kept_mass"}
        computed = {key: value for key, value in given.items() if key != "rollout_kept_ids"}
        replay_computed = _old_log_probs(actor, computed, thd)
        replay_given = _old_log_probs(actor, given, thd)
        set_plan(model, dataclasses.replace(plan, sampling_replay=False))
        full = _old_log_probs(actor, computed, thd)
        set_plan(model, plan)
        # bypass_mode: pi_old = pi_rollout, and the update replays the rollout's sets
        update = dict(given, old_log_probs=fields["rollout_log_probs"])
        data = packed(update, TEMPERATURE, calculate_entropy=True, global_batch_size=len(PROMPT_LENGTHS),
                      **_engine_keys(2, thd))  # fmt: skip
        with actor.train_mode():
            output = actor.train_batch(data, loss_function=_ppo_loss(len(PROMPT_LENGTHS)))
            without_sets = packed(dict(computed, old_log_probs=fields["rollout_log_probs"]), TEMPERATURE,
                                  calculate_entropy=True, global_batch_size=len(PROMPT_LENGTHS),
                                  **_engine_keys(2, thd))  # fmt: skip
            try:
                actor.train_batch(without_sets, loss_function=_ppo_loss(len(PROMPT_LENGTHS)))
                missing = None
            except ValueError as error:
                missing = str(error)
    rollout = fields["rollout_log_probs"]
    return {
        "plan": (plan.sampling_replay, plan.replay_top_k, plan.replay_top_p),
        "computed_ratio": (replay_computed - rollout).exp()[mask],
        "given_ratio": (replay_given - rollout).exp()[mask],
        "full_ratio": (full - rollout).exp()[mask],
        "kept_mass": fields["kept_mass"][mask],
        "ppo_kl": metric_values(output["metrics"]["actor/ppo_kl"]),
        "missing": missing,
    }


@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_grpo_step_with_replay_has_ratio_one_and_without_the_kept_mass(layout):
    result = run_in_processes(_replay_worker, 1, layout)[0]
    assert result["plan"] == (True, TOP_K, TOP_P)
    ones = torch.ones_like(result["computed_ratio"])
    torch.testing.assert_close(result["computed_ratio"], ones, rtol=0, atol=RATIO_TOLERANCE)
    torch.testing.assert_close(result["given_ratio"], ones, rtol=0, atol=RATIO_TOLERANCE)
    # without replay the trainer's full-vocabulary log-prob over the rollout's renormalized one is the kept mass
    torch.testing.assert_close(result["full_ratio"], result["kept_mass"], rtol=RATIO_TOLERANCE, atol=0)
    assert float(result["kept_mass"].max()) < 0.5  # the bias is real here, not a ratio near 1 by accident
    assert result["ppo_kl"] and all(abs(value) < 1e-6 for value in result["ppo_kl"]), result["ppo_kl"]
    # a training step never computes its own sets: without the rollout's (or pi_old's) it stops, naming the field
    assert result["missing"].startswith(
        "rollout_kept_ids: actor_rollout_ref.model.fused_kernel_options.output_processor_sampling_replay=true needs "
        "the kept sets in the update batch, the rollout's or pi_old's;"
    ), result["missing"]


class EngineWorkerGroup:
    """Named fake of verl's actor worker group: `compute_log_prob` runs the engine's forward-only pass and returns
    what `TrainingWorker.infer_batch` returns (the model outputs and metrics in one TensorDict)."""

    def __init__(self, engine, remove_padding: bool):
        self.engine, self.remove_padding = engine, remove_padding

    def compute_log_prob(self, data):
        from verl.utils import tensordict_utils as tu

        keys = _engine_keys(2, self.remove_padding)
        tu.assign_non_tensor(data, **{key: value for key, value in keys.items() if key not in data.keys()})
        tu.pop(data, key="no_lora_adapter", default=False)
        with self.engine.eval_mode():
            output = self.engine.infer_batch(data, loss_function=None)
        return tu.get_tensordict(tensor_dict=output["model_output"], non_tensor_dict={"metrics": {"mfu": 0.0}})


class ReplayTrainer:
    """Named fake of RayPPOTrainer's state its old-log-prob and reference passes read (reference in the actor)."""

    def __init__(self, worker_group, fused_kernel_options: dict):
        from omegaconf import OmegaConf

        self.actor_rollout_wg = worker_group
        self.ref_in_actor = True
        self.config = OmegaConf.create(
            {"actor_rollout_ref": {"actor": {}, "model": {"fused_kernel_options": fused_kernel_options}}}
        )


def _carry_worker(rank: int, world_size: int, layout: str) -> dict:
    from verl import DataProto

    from verl_fused_hook.switch import ENV_VAR
    from verl_fused_hook.verl_integration import install
    from verl_fused_hook.verl_integration.model_plan import plan_of, set_plan
    from verl_fused_hook.verl_integration.replay_carry import REPLAYED_COUNTS_KEY, kept_ids_of_outputs
    from verl_fused_hook_harness.stand_ins.cuda_on_cpu import cuda_names_on_cpu
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel
    from verl_fused_hook_harness.support.verl_engine import prepare_verl_process

    thd = layout == "thd"
    prepare_verl_process(rank)
    init_model_parallel(1, seed=5)
    os.environ[ENV_VAR] = "1"
    install()
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    options = {"output_processor_sampling_replay": True}
    with cuda_names_on_cpu():
        actor, model, fields = _replay_engine(thd, CARRY_LR, options)
        plan = plan_of(model)
        tensors = {key: value for key, value in fields.items() if key not in ("kept_mass", "rollout_kept_ids")}
        tensors["temperature"] = torch.full((len(PROMPT_LENGTHS),), TEMPERATURE)
        batch = DataProto.from_dict(tensors=tensors)
        group = EngineWorkerGroup(actor, thd)
        trainer = ReplayTrainer(group, options)
        old_log_prob, _ = RayPPOTrainer._compute_old_log_prob(trainer, batch)
        carried = old_log_prob.batch["rollout_kept_ids"]
        batch = batch.union(old_log_prob)  # as RayPPOTrainer.fit does
        reference = RayPPOTrainer._compute_ref_log_prob(trainer, batch).batch["ref_log_prob"]
        trainer_full = ReplayTrainer(group, dict(options, output_processor_sampling_replay_reference=False))
        reference_full = RayPPOTrainer._compute_ref_log_prob(trainer_full, batch).batch["ref_log_prob"]
        set_plan(model, dataclasses.replace(plan, sampling_replay=False))
        full = _old_log_probs(actor, tensors, thd)
        set_plan(model, plan)

        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import left_right_2_no_padding

        update = left_right_2_no_padding(batch.to_tensordict())
        tu.assign_non_tensor(update, calculate_entropy=True, global_batch_size=len(PROMPT_LENGTHS),
                             **_engine_keys(2, thd))  # fmt: skip
        update_sets, weight_moved = [], []
        for _ in range(2):
            before = [p.detach().clone() for p in model.parameters()]
            with actor.train_mode():
                output = actor.train_batch(update, loss_function=_ppo_loss(len(PROMPT_LENGTHS)))
            update_sets.append(kept_ids_of_outputs(output["model_output"], update))
            weight_moved.append(max(float((p.detach() - b).abs().max()) for p, b in zip(model.parameters(), before)))
        after_steps = RayPPOTrainer._compute_old_log_prob(trainer, DataProto.from_dict(tensors=tensors))[0]
    mask = fields["response_mask"].bool()
    return {
        "old_log_probs": old_log_prob.batch["old_log_probs"],
        "carried": carried,
        "rollout_sets": fields["rollout_kept_ids"],
        "mask": mask,
        "reference": reference,
        "reference_full": reference_full,
        "full": full,
        "update_sets": update_sets,
        "weight_moved": weight_moved,
        "recomputed_after_steps": after_steps.batch["rollout_kept_ids"],
        "returned_keys_old": REPLAYED_COUNTS_KEY in output["model_output"],
    }


def _as_sets(kept: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [sorted(int(i) for i in row if i >= 0) for row in kept[mask]]


@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_pi_old_sets_reach_the_update_and_reference_passes(layout):
    result = run_in_processes(_carry_worker, 1, layout)[0]
    mask, carried = result["mask"], result["carried"]
    assert carried.dtype == torch.int32 and carried.shape[:2] == mask.shape
    assert bool((carried[~mask] == -1).all())  # no set outside the responses
    # pi_old's sets are vLLM's rule on the same model's logits: the rollout's sets, up to fp boundary cases
    same = sum(a == b for a, b in zip(_as_sets(carried, mask), _as_sets(result["rollout_sets"], mask)))
    assert same == int(mask.sum()), f"{same} of {int(mask.sum())} sets as the rollout's"
    # the update replays exactly pi_old's sets, before and after an optimizer step moved the weights
    assert all(moved > 0 for moved in result["weight_moved"]), result["weight_moved"]
    for update_sets in result["update_sets"]:
        assert torch.equal(update_sets[:, :, : carried.shape[2]], carried)
    # the sets the moved weights would give differ: the update kept pi_old's, not recomputed ones
    recomputed = _as_sets(result["recomputed_after_steps"], mask)
    changed = sum(a != b for a, b in zip(recomputed, _as_sets(carried, mask)))
    assert changed > 0, "the optimizer steps changed no kept set; raise CARRY_LR"
    # reference (same weights as pi_old here): replaying pi_old's sets gives pi_old's log-probs bit for bit;
    # output_processor_sampling_replay_reference=false gives the full-vocabulary log-probs
    assert torch.equal(result["reference"][mask], result["old_log_probs"][mask])
    assert torch.equal(result["reference_full"][mask], result["full"][mask])
    assert not torch.equal(result["reference_full"][mask], result["reference"][mask])
