"""A model learning through sampling replay (issue 54 item 5), CPU-sized: `replay-learning`'s three arms through verl's
real engine on a tiny Qwen2, rollouts sampled from the model itself with top_k=50, top_p=0.9 (vLLM's rule, fp64).

With replay the trainer's pi_old equals the rollout's processed log-prob (ratio 1 within fp32 numerics, nothing
clipped) and the reward rises; without it (legacy and hook mode alike) the ratio is the kept mass, every step.
"""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook_harness.commands.train import replay_learning
from verl_fused_hook_harness.support.hf_model import TINY_QWEN2

STEPS = 20
WINDOW = 5  # steps averaged at the start and the end
# fp32 logits of one model through the sampler's fp32 matmul and the op, exp'd (the engine test measured 4.8e-7)
RATIO_TOLERANCE = 2e-6
# the replay arm's reward over the first and last WINDOW steps: measured 0.015 -> 0.101 (no replay: 0.013 -> 0.043)
REWARD_RISE = 0.04


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay_learning")
    parser = replay_learning.build_parser()
    args = parser.parse_args(["--device", "cpu", "--steps", str(STEPS), "--prompts", "8", "--out", str(out)])
    return replay_learning.run(replay_learning.plan_from_args(parser, args)), out


def test_replay_keeps_the_ratio_at_one_and_the_model_learns(report):
    report, out = report
    rows = report["runs"]["hook+replay"]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        assert abs(r["ratio_mean"] - 1) < RATIO_TOLERANCE, r
        assert r["ratio_outside_band"] == 0 and r["pg_clipfrac"] == 0, r
        assert abs(r["ppo_kl"]) < 1e-6, r
    first = sum(r["reward"] for r in rows[:WINDOW]) / WINDOW
    last = sum(r["reward"] for r in rows[-WINDOW:]) / WINDOW
    assert last > first + REWARD_RISE, (first, last)
    assert (out / "replay_learning.json").is_file() and (out / "replay_learning.png").is_file()
    assert len((out / "steps_hook_replay.jsonl").read_text().splitlines()) == STEPS


def test_without_replay_the_ratio_is_the_kept_mass(report):
    report, _ = report
    for arm in ("legacy", "hook"):
        for r in report["runs"][arm]:
            # per token pi_full / pi_processed is the kept set's full-vocabulary mass, so their means agree
            assert r["ratio_mean"] == pytest.approx(r["kept_mass"], rel=1e-5), (arm, r)
            assert r["ratio_mean"] < 0.9 and r["pg_clipfrac"] > 0, (arm, r)
    # the same weights and prompts at step 1: legacy and hook mode sample the same rollout
    legacy, hook = report["runs"]["legacy"][0], report["runs"]["hook"][0]
    assert legacy["reward"] == hook["reward"] and legacy["kept_size"] == hook["kept_size"]
    assert report["device"] == "cpu" and set(report["summary"]) == set(replay_learning.ARMS)
    assert report["failed"] == {}


def test_replay_at_tensor_parallel_two_keeps_the_ratio_at_one(tmp_path):
    """TP=2 (two gloo processes; mbridge turns sequence parallelism on): the rollout is sampled from the gathered
    logits, the engine replays its sets on vocabulary shards."""
    parser = replay_learning.build_parser()
    args = parser.parse_args(["--device", "cpu", "--tp", "2", "--steps", "3", "--prompts", "4", "--n", "4",
                              "--micro-batch", "8", "--arms", "hook,hook+replay", "--out", str(tmp_path)])  # fmt: skip
    report = replay_learning.run(replay_learning.plan_from_args(parser, args))
    assert report["failed"] == {}
    for r in report["runs"]["hook+replay"]:
        assert abs(r["ratio_mean"] - 1) < RATIO_TOLERANCE and r["pg_clipfrac"] == 0, r
    for r in report["runs"]["hook"]:
        assert r["ratio_mean"] == pytest.approx(r["kept_mass"], rel=1e-5), r


def test_task_rewards_score_successors_and_alphabet_tokens():
    first = replay_learning.FIRST_ALPHABET_ID
    prompts = torch.tensor([[first + 2], [first + 3]])
    # alphabet of 4: the successor of 2 is 3, of 3 is 0 (cyclic); 999 is outside the alphabet, and the token after it
    # is no successor ((999 - first + 1) % 4 = 1 would be, were 999 a letter)
    responses = torch.tensor([
        [first + 3, first + 0, first + 2, 999, first + 1],
        [first + 0, first + 0, first + 1, first + 2, first + 3],
    ])  # fmt: skip
    rewards = replay_learning.task_rewards(prompts, responses, alphabet=4)
    torch.testing.assert_close(rewards, torch.tensor([(1 + 1 + 0.25 + 0 + 0.25) / 5, (1 + 0.25 + 1 + 1 + 1) / 5]))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--top-k", "-1", "--top-p", "1.0"], "replay needs a truncation"),
        (["--alphabet", "998"], "--alphabet: expected 2..997"),
        (["--arms", "hook,replay"], "--arms: unknown ['replay']"),
        (["--n", "1"], "--n: GRPO's advantages need >= 2"),
        (["--prompts", "3", "--micro-batch", "16"], "--micro-batch: verl's update splits the 24 sequences"),
    ],
)
def test_bad_arguments_are_refused_naming_the_flag(argv, message, capsys):
    parser = replay_learning.build_parser()
    args = parser.parse_args(["--device", "cpu", "--hf-config", str(TINY_QWEN2), "--out", "x", *argv])
    with pytest.raises(SystemExit):
        replay_learning.plan_from_args(parser, args)
    assert message in capsys.readouterr().err
