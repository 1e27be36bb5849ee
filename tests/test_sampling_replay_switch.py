"""The sampling-replay entries: parsed like the others, refused at start-up where replay cannot mean anything, one
log line when on, and the rollout's sampling carried from ActorRolloutRefWorker.init_model to the engine build."""

import dataclasses
import logging

import pytest
import torch
from omegaconf import OmegaConf

from verl_fused_hook.switch import ENV_VAR, resolve_plan
from verl_fused_hook.verl_integration.sampling_replay import (
    RolloutSampling,
    _sampling,
    make_init_model,
    plan_with_rollout_sampling,
    rollout_sampling,
)

PREFIX = "actor_rollout_ref.model.fused_kernel_options"
HOOK = {ENV_VAR: "1"}


def replay_plan(**entries):
    return resolve_plan({"output_processor_sampling_replay": True, **entries}, environ=HOOK)


def test_replay_is_off_by_default_and_reaches_the_plan():
    assert resolve_plan({}, environ=HOOK).sampling_replay is False
    assert resolve_plan({"output_processor_sampling_replay": None}, environ=HOOK).sampling_replay is False
    plan = replay_plan()
    assert (plan.sampling_replay, plan.replay_max_kept) == (True, 512)
    assert replay_plan(output_processor_sampling_replay_max_kept=64).replay_max_kept == 64


def test_replay_outside_hook_mode_is_ignored_with_a_note():
    plan = resolve_plan({"output_processor_sampling_replay": True}, environ={ENV_VAR: "0"})
    assert plan.sampling_replay is False
    assert plan.note == f"{PREFIX}.output_processor_sampling_replay=true ignored outside hook mode"


@pytest.mark.parametrize("value", ["yes", 1, 0.5])
def test_replay_entry_must_be_a_bool(value):
    with pytest.raises(ValueError) as error:
        resolve_plan({"output_processor_sampling_replay": value}, environ=HOOK)
    assert str(error.value) == (
        f"{PREFIX}.output_processor_sampling_replay={value!r} is not allowed; use true, false or null (off)"
    )


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "64"])
def test_max_kept_must_be_a_positive_integer(value):
    with pytest.raises(ValueError) as error:
        replay_plan(output_processor_sampling_replay_max_kept=value)
    assert str(error.value) == (
        f"{PREFIX}.output_processor_sampling_replay_max_kept={value!r} is not allowed; use an integer >= 1 (the "
        "widest kept set, at least rollout.top_k) or null (512)"
    )


def test_max_kept_without_replay_is_ignored_with_a_note():
    plan = resolve_plan({"output_processor_sampling_replay_max_kept": 64}, environ=HOOK)
    assert plan.note == f"{PREFIX}.output_processor_sampling_replay_max_kept ignored: sampling replay is off"


def test_replay_needs_a_backend_with_the_op():
    with pytest.raises(ValueError) as error:
        replay_plan(output_processor_backend="verl")
    assert str(error.value) == (
        f"{PREFIX}.output_processor_sampling_replay=true needs the op: {PREFIX}.output_processor_backend=verl runs a "
        "kernel that cannot find or replay kept sets; use output_processor_backend=auto"
    )


def refusal(plan, sampling):
    with pytest.raises(ValueError) as error:
        if sampling is None:
            plan_with_rollout_sampling(plan)
        else:
            with rollout_sampling(sampling):
                plan_with_rollout_sampling(plan)
    return str(error.value)


def test_refused_without_truncation():
    assert refusal(replay_plan(), RolloutSampling(top_k=-1, top_p=1.0)) == (
        f"{PREFIX}.output_processor_sampling_replay=true: no truncation configured (actor_rollout_ref.rollout.top_k=-1 "
        "and actor_rollout_ref.rollout.top_p=1), so every kept set is the whole vocabulary; set "
        "actor_rollout_ref.rollout.top_k >= 1 or actor_rollout_ref.rollout.top_p < 1, or the entry to false"
    )


def test_refused_unless_logprobs_are_processed():
    assert refusal(replay_plan(), RolloutSampling(top_p=0.9, logprobs_mode="raw_logprobs")) == (
        f"{PREFIX}.output_processor_sampling_replay=true: actor_rollout_ref.rollout.logprobs_mode='raw_logprobs' "
        "returns log-probs that are not renormalized over the kept set; use "
        "actor_rollout_ref.rollout.logprobs_mode=processed_logprobs, or the entry to false"
    )


def test_refused_when_the_bound_is_below_top_k():
    plan = replay_plan(output_processor_sampling_replay_max_kept=32)
    assert refusal(plan, RolloutSampling(top_k=50)) == (
        f"{PREFIX}.output_processor_sampling_replay_max_kept=32 is smaller than actor_rollout_ref.rollout.top_k=50; "
        "use an integer >= 50"
    )


def test_refused_without_the_rollout_config():
    assert refusal(replay_plan(), None).startswith(
        f"{PREFIX}.output_processor_sampling_replay=true needs the rollout's top_k / top_p, and this engine was built "
        "outside verl's ActorRolloutRefWorker.init_model"
    )


def test_plan_takes_the_rollout_truncation_and_logs_once(caplog):
    caplog.set_level(logging.INFO, logger="verl_fused_hook")
    with rollout_sampling(RolloutSampling(top_k=50, top_p=0.9)):
        plan = plan_with_rollout_sampling(replay_plan())
        plan_with_rollout_sampling(replay_plan())
    assert (plan.replay_top_k, plan.replay_top_p) == (50, 0.9)
    lines = [r.getMessage() for r in caplog.records if "sampling_replay" in r.getMessage()]
    assert lines == [
        "verl_fused_hook: output_processor_sampling_replay: log-probs renormalized over the rollout's kept sets "
        "(top_k=50, top_p=0.9, at most 512 ids per token)"
    ]
    assert plan.log_line("MegatronEngine").endswith(
        "output_processor_sampling_replay=true (rollout top_k=50, top_p=0.9, "
        "output_processor_sampling_replay_max_kept=512)"
    )


def test_a_plan_without_replay_needs_no_rollout():
    plan = resolve_plan({}, environ=HOOK)
    assert plan_with_rollout_sampling(plan) is plan


def test_init_model_builds_its_engines_knowing_the_rollout_sampling():
    seen = []

    class Worker:
        config = OmegaConf.create({"rollout": {"top_k": 50, "top_p": 0.9, "logprobs_mode": "processed_logprobs"}})

        def init_model(self):
            seen.append(_sampling.get())

    Worker.init_model = make_init_model(Worker.init_model)
    Worker().init_model()
    assert seen == [RolloutSampling(top_k=50, top_p=0.9, logprobs_mode="processed_logprobs")]
    assert _sampling.get() is None


def test_doctor_line_checks_the_rollout_as_the_build_does(monkeypatch):
    from verl_fused_hook_harness.commands.doctor import check_sampling_replay

    monkeypatch.setenv(ENV_VAR, "1")
    on = f"+{PREFIX}.output_processor_sampling_replay=true"
    assert check_sampling_replay(None, []).line() == (
        f"[  ok] replay         off ({PREFIX}.output_processor_sampling_replay not true in hook mode)"
    )
    assert check_sampling_replay(None, [on, "actor_rollout_ref.rollout.top_k=50"]).line() == (
        "[  ok] replay         on: log-probs renormalized over the rollout's kept sets (top_k=50, top_p=1, at most "
        "512 ids per token)"
    )
    refused = check_sampling_replay(None, [on])
    assert (refused.status, refused.text) == (
        "FAIL",
        refusal(replay_plan(), RolloutSampling(top_k=-1, top_p=1.0)),
    )


def _batch(**fields):
    from verl.utils import tensordict_utils as tu

    return tu.get_tensordict(fields)


def test_a_replay_step_refuses_what_reads_the_full_vocabulary():
    from verl_fused_hook.verl_integration.forward_step import replay_of_step

    plan = replay_plan()
    for tokens, flag in (({"distillation": object()}, "distillation_use_topk"), ({"sum_pi_squared": True}, None)):
        flag = flag or "calculate_sum_pi_squared"
        with pytest.raises(ValueError) as error:
            replay_of_step(_batch(x=torch.zeros(2)), plan, tokens, True)
        assert str(error.value) == (
            f"{PREFIX}.output_processor_sampling_replay=true cannot run a step with {flag}: it reads the "
            "full-vocabulary distribution, not the kept set; set output_processor_sampling_replay to false for such "
            "a job"
        )
    assert replay_of_step(_batch(x=torch.zeros(2)), resolve_plan({}, environ=HOOK), {}, True) is None


def test_a_pass_marked_full_vocabulary_is_not_replayed():
    from verl.utils import tensordict_utils as tu

    from verl_fused_hook.verl_integration.forward_step import replay_of_step
    from verl_fused_hook.verl_integration.replay_carry import FULL_VOCABULARY_KEY

    batch = _batch(x=torch.zeros(2))
    tu.assign_non_tensor(batch, **{FULL_VOCABULARY_KEY: True})
    # even a step that would otherwise be refused: the mark means "no replay here"
    assert replay_of_step(batch, replay_plan(), {"sum_pi_squared": True}, True) is None


def test_the_rollouts_sets_land_on_the_rows_that_predict_each_response_token():
    from verl_fused_hook.verl_integration.sampling_replay import step_replay

    plan = dataclasses.replace(replay_plan(), replay_top_k=4)
    offsets = torch.tensor([0, 5, 8])  # sequence 0: prompt 3 + response 2; sequence 1: prompt 1 + response 2
    input_ids = torch.nested.nested_tensor_from_jagged(torch.arange(8), offsets=offsets)
    kept = torch.tensor([[[7, 1], [2, -1]], [[5, -1], [6, 9]]])
    batch = {"input_ids": input_ids, "rollout_kept_ids": kept}
    replay = step_replay(_Keys(batch), plan, torch.tensor([3, 1]), torch.tensor([2, 2]))
    # given sets: max_kept + 1, room for pi_old's computed set of max_kept plus its added label
    assert (replay.top_k, replay.max_kept) == (4, 513)
    rows = replay.kept_ids.values().tolist()
    assert rows == [[-1, -1], [-1, -1], [7, 1], [2, -1], [-1, -1], [5, -1], [6, 9], [-1, -1]]
    with pytest.raises(ValueError) as error:
        step_replay(_Keys(dict(batch, rollout_kept_ids=kept[:, :1])), plan, torch.tensor([3, 1]), torch.tensor([2, 2]))
    assert str(error.value) == "rollout_kept_ids: holds 1 response positions, the longest response has 2"


class _Keys(dict):
    """A batch as step_replay reads it (keys() and items)."""


def test_reference_entry_is_a_bool_and_noted_without_replay():
    from verl_fused_hook.switch import parse_config_replay_reference

    assert parse_config_replay_reference({}) is None
    assert parse_config_replay_reference({"output_processor_sampling_replay_reference": False}) is False
    with pytest.raises(ValueError) as error:
        replay_plan(output_processor_sampling_replay_reference="no")
    assert str(error.value) == (
        f"{PREFIX}.output_processor_sampling_replay_reference='no' is not allowed; use true, false or null (true: the "
        "reference replays the kept sets)"
    )
    plan = resolve_plan({"output_processor_sampling_replay_reference": False}, environ=HOOK)
    assert plan.note == f"{PREFIX}.output_processor_sampling_replay_reference ignored: sampling replay is off"
