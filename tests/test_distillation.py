"""verl's on-policy distillation and Optimal Token Baseline through verl's real engine (CPU, gloo), hook mode against
verl's unfused path (issue 43).

Each launch (TP=1 and TP=2, sequence parallelism on at TP=2) builds verl's `MegatronEngineWithLMHead` through
verl's own `__init__` / `initialize()` (support/train_engine.py) per side and runs `forward_backward_batch` with
`distillation_ppo_loss` bound as verl's worker binds it, the DistillationConfig composed from verl's Hydra config
(support/distillation.py), on GRPO micro-batches in verl's packed layout with mixed per-sample temperatures and a
teacher's top-k nested as verl's `left_right_2_no_padding` nests it (ids over every TP shard, repeated ids):

- verl's unfused path (use_fused_kernels=False: `_lm_head_logits_processor` over full logits) is the reference;
- hook mode (VERL_FUSED_USE_OP_HOOK=1): the op `token_log_probs` in the hook, verl's final loss unchanged;
- hook mode with `output_processor_fused_loss=true`: the estimator losses inside the op.

Asserted within 1e-5 (relative to each quantity's largest magnitude): each micro-batch's loss, every metric verl
returns, every model output verl's loss reads (`distillation_losses`, `student_mass`, `teacher_mass`,
`overlap_count`, `overlap_token_advantage`, log-probs, entropy) on the response rows, every parameter gradient
on every rank; for forward_kl_topk with the clamps binding and not, `use_policy_gradient` on and off,
`use_task_rewards` on and off (`distillation_only`), THD and BSHD; the estimator losses; sum pi^2 against verl's
`vocab_parallel_sum_pi_squared`. Also what happened before and what verl's own paths do: its legacy fused forward
stops with `KeyError: 'distillation_losses'` and refuses sum pi^2 (NotImplementedError), and its unfused BSHD
path fails its own shape assertion with `pad_bshd_to_minibatch_max=True` (its default). Bad teacher fields stop the
step with a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os

import pytest
import torch

from verl_fused_hook_harness.support.distributed import run_in_processes

SEED = 1234
RTOL = 1e-5
SHAPE = dict(prompts=4, n=2, prompt_lengths=(3, 9), response_lengths=(2, 20))  # 8 sequences, 2 micro-batches
TEMPERATURES = (0.7, 1.0, 0.5, 1.3, 0.9, 1.0, 0.6, 1.1)
VOCAB = 1000  # the tiny Qwen2's; its output layer holds 1024 rows (512 a rank at TP=2)

TOPK_CASES = {
    "topk": "topk",  # supervised (use_policy_gradient=False) with the task's ppo_loss, both clamps binding
    "topk-unclamped": "topk",
    "topk-pg": "topk-pg",  # the negative KL as the advantage of verl's vanilla policy loss, no task reward
    "topk-only": "topk-only",  # neither: the trainer sets distillation_only, no log-probs computed
}
ESTIMATOR_CASES = {  # verl's registered single-sample estimators; k1 / kl only as policy gradient (verl refuses else)
    "kl": dict(loss_mode="kl", use_policy_gradient=True, use_task_rewards=False),
    "k1": dict(loss_mode="k1", use_policy_gradient=True, loss_max_clamp=0.5),
    "abs": dict(loss_mode="abs", use_policy_gradient=False, loss_max_clamp=0.5),
    "mse": dict(loss_mode="mse", use_policy_gradient=False, use_task_rewards=False),
    "k2": dict(loss_mode="k2", use_policy_gradient=True, use_task_rewards=False),
    "low_var_kl": dict(loss_mode="low_var_kl", use_policy_gradient=False),
    "k3": dict(loss_mode="k3", use_policy_gradient=True, loss_max_clamp=0.5),
}
OUTPUT_KEYS = (
    "log_probs",
    "entropy",
    "distillation_losses",
    "student_mass",
    "teacher_mass",
    "overlap_count",
    "overlap_token_advantage",
)
UNFUSED, HOOK, HOOK_FUSED_LOSS, LEGACY = "unfused", "hook", "hook-fused-loss", "legacy"


def loss_entries(case: str) -> dict:
    from verl_fused_hook_harness.support.distillation import PRESETS

    if case in ESTIMATOR_CASES:
        return ESTIMATOR_CASES[case]
    entries = dict(PRESETS[TOPK_CASES[case]])
    if case == "topk-unclamped":
        entries.update(log_prob_min_clamp=None, loss_max_clamp=None)
    return entries


def actor_config():
    from verl.workers.config.actor import McoreActorConfig

    return McoreActorConfig(
        ppo_mini_batch_size=SHAPE["prompts"], ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=False,
        entropy_coeff=0.01, rollout_n=SHAPE["n"],
    )  # fmt: skip


def batch(
    case: str, padded_layout: bool, fused_kernels: bool, actor_update: bool = True, mixed_temperatures=True, **extra
):
    """The batch as verl's trainer hands it over: GRPO rollout, old log-probs, the teacher's top-k and, for an
    actor update, the trainer's distillation flags."""
    from verl_fused_hook_harness.support.distillation import add_teacher, distillation_config, step_flags
    from verl_fused_hook_harness.support.grpo_batches import RolloutShape, packed, rollout

    shape = RolloutShape(**SHAPE)
    fields = rollout(shape, VOCAB, SEED, 1)
    generator = torch.Generator().manual_seed(SEED)
    fields["old_log_probs"] = -6.9 + 0.2 * torch.randn(fields["responses"].shape, generator=generator)
    config = distillation_config(**loss_entries(case))
    add_teacher(fields, config, VOCAB, SEED)
    data = packed(
        fields, 1.0, calculate_entropy=True, global_batch_size=shape.sequences, use_remove_padding=not padded_layout,
        use_dynamic_bsz=False, micro_batch_size_per_gpu=4, use_fused_kernels=fused_kernels,
        **(step_flags(config) if actor_update else {}), **extra,
    )  # fmt: skip
    if mixed_temperatures:  # verl's legacy fused forward refuses them
        data["temperature"] = torch.tensor(TEMPERATURES)
    return data


def loss_function(case: str):
    from verl_fused_hook_harness.support.distillation import distillation_config
    from verl_fused_hook_harness.support.distillation import loss_function as distillation_loss

    return distillation_loss(actor_config(), distillation_config(**loss_entries(case)))


def _metric(value) -> list[float]:
    values = getattr(value, "values", value)
    return [float(v) for v in (values if isinstance(values, (list, tuple)) else [values])]


def update(engine, case: str, padded_layout: bool, fused_kernels: bool, mixed_temperatures=True) -> dict:
    """One actor micro-batch loop (`forward_backward_batch`), what verl reports and every gradient."""
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_fused_hook.verl_integration.model_plan import counts_of

    data = batch(case, padded_layout, fused_kernels, mixed_temperatures=mixed_temperatures)
    engine.optimizer_zero_grad()
    fused_before = sum(counts_of(m).fused_loss_forwards for m in engine.module)
    with engine.train_mode():  # which zeroes the gradients on exit: read them inside
        output = engine.forward_backward_batch(data, loss_function(case), forward_only=False)
        grads = {
            n: p.main_grad.detach().clone() for m in engine.module for n, p in m.named_parameters() if p.requires_grad
        }
    assert any(float(grad.abs().max()) > 0 for grad in grads.values())
    model_output = output.get("model_output", {})
    return {
        "losses": [float(x) for x in output["loss"]],
        "metrics": {key: _metric(value) for key, value in output["metrics"].items()},
        "outputs": {
            key: no_padding_2_padding(model_output[key].detach().cpu(), data).double()
            for key in OUTPUT_KEYS
            if key in model_output
        },
        "grads": grads,
        "fused_forwards": sum(counts_of(m).fused_loss_forwards for m in engine.module) - fused_before,
    }


def sum_pi_squared(engine, fused_kernels: bool, mixed_temperatures=True, padded_layout=False) -> torch.Tensor:
    """The trainer's old-log-prob call (`_compute_old_log_prob`) with calculate_sum_pi_squared, on the responses."""
    from verl.workers.utils.padding import no_padding_2_padding

    data = batch(
        "topk", padded_layout, fused_kernels, False, mixed_temperatures=mixed_temperatures,
        calculate_sum_pi_squared=True,
    )  # fmt: skip
    with engine.eval_mode():
        output = engine.infer_batch(data)
    return no_padding_2_padding(output["model_output"]["sum_pi_squared"], data).double().cpu()


def build(world_size: int, side: str, padded_layout: bool = False, pad_bshd_to_minibatch_max: bool = True):
    from verl_fused_hook_harness.support.hf_model import TINY_QWEN2
    from verl_fused_hook_harness.support.train_engine import EngineSetup, build_engine

    os.environ.pop("VERL_FUSED_USE_OP_HOOK", None)
    if side != UNFUSED:
        os.environ["VERL_FUSED_USE_OP_HOOK"] = "0" if side == LEGACY else "1"
    options = {} if side in (UNFUSED, LEGACY) else {"output_processor_backend": "torch"}
    if side == HOOK_FUSED_LOSS:
        options["output_processor_fused_loss"] = True
    setup = EngineSetup(
        hf_path=str(TINY_QWEN2), tp=world_size, dtype="float32", seed=SEED, micro_batch_size=4, total_steps=1,
        lr=1e-4, offload=False, fused_kernel_options=options, use_fused_kernels=side != UNFUSED,
        use_remove_padding=not padded_layout, pad_bshd_to_minibatch_max=pad_bshd_to_minibatch_max,
    )  # fmt: skip
    return build_engine(setup)


class _LogLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _outcome(fn) -> dict:
    """{"error": "Type: message"} of what fn() raised, or {"result": its value}."""
    try:
        return {"result": fn()}
    except Exception as error:  # the test reads which error, and its message
        return {"error": f"{type(error).__name__}: {error}"}


def worker(rank: int, world_size: int) -> dict:
    from verl_fused_hook.verl_integration import install
    from verl_fused_hook_harness.stand_ins.cuda_on_cpu import cuda_names_on_cpu
    from verl_fused_hook_harness.stand_ins.legacy_kernel_swap import portable_legacy_kernel_on_cpu
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel
    from verl_fused_hook_harness.support.train_engine import release_engines

    install()
    log = _LogLines()
    logging.getLogger("verl_fused_hook").addHandler(log)
    init_model_parallel(world_size, seed=SEED)
    results = {}
    with cuda_names_on_cpu():
        # the packed layout: every case on verl's unfused path, hook mode, hook mode with the fused loss
        for side in (UNFUSED, HOOK, HOOK_FUSED_LOSS):
            engine = build(world_size, side)
            for case in (*TOPK_CASES, *ESTIMATOR_CASES):
                results["thd", case, side] = update(engine, case, False, side != UNFUSED)
            if side != HOOK_FUSED_LOSS:
                results["sum_pi_squared", side] = _outcome(functools.partial(sum_pi_squared, engine, side != UNFUSED))
            if side == HOOK and rank == 0 and world_size == 1:
                results["bad_inputs"] = bad_inputs(engine)
            release_engines(engine)
        # the padded layout: verl's unfused path needs micro-batches padded to their own longest (see the module doc)
        for side, pad in ((UNFUSED, False), (HOOK, True)):
            engine = build(world_size, side, padded_layout=True, pad_bshd_to_minibatch_max=pad)
            for case in TOPK_CASES:
                results["bshd", case, side] = update(engine, case, True, side != UNFUSED)
            results["sum_pi_squared_bshd", side] = _outcome(
                lambda: sum_pi_squared(engine, side != UNFUSED, padded_layout=True)
            )
            release_engines(engine)
        engine = build(world_size, UNFUSED, padded_layout=True)  # verl's default padding
        results["bshd", "verl_default_padding"] = _outcome(lambda: update(engine, "topk", True, False))
        release_engines(engine)
        with portable_legacy_kernel_on_cpu("cpu"):  # verl's Triton kernel cannot run here
            engine = build(world_size, LEGACY)
            results["legacy", "topk"] = _outcome(lambda: update(engine, "topk", False, True, mixed_temperatures=False))
            results["legacy", "sum_pi_squared"] = _outcome(lambda: sum_pi_squared(engine, True, False))
            release_engines(engine)
    os.environ.pop("VERL_FUSED_USE_OP_HOOK", None)
    results["log"] = log.lines
    return results


# ---------------------------------------------------------------- bad input


def _replaced(data, field: str, change):
    """`data` with `field`'s nested values changed by `change` (a function of the values)."""
    nested = data[field]
    values = change(nested.values().clone())
    data[field] = torch.nested.nested_tensor_from_jagged(values, offsets=nested.offsets())
    return data


def bad_inputs(engine) -> dict:
    """What one hook-mode update says about each kind of bad teacher field (error messages by name)."""
    from verl_fused_hook.verl_integration.forward_step import token_step

    def run(case, tamper):
        data = tamper(batch(case, False, True))
        engine.optimizer_zero_grad()
        with engine.train_mode():
            engine.forward_backward_batch(data, loss_function(case), forward_only=False)

    def other_lengths(data):
        shorter = batch("topk", False, True)
        values, offsets = shorter["teacher_ids"].values(), shorter["teacher_ids"].offsets().clone()
        offsets[1:] -= 1  # the first sequence one token shorter: the rows no longer line up with input_ids
        data["teacher_ids"] = torch.nested.nested_tensor_from_jagged(values[1:], offsets=offsets)
        return data

    def one_column(values):
        return values[:, :1]

    def token_row(row: int, value):
        return lambda values: values.index_fill(0, torch.tensor([row]), value)

    tampers = {
        "id_past_vocabulary": ("topk", lambda d: _replaced(d, "teacher_ids", token_row(5, 1024))),
        "negative_id": ("topk", lambda d: _replaced(d, "teacher_ids", token_row(3, -1))),
        "nan_log_prob": ("topk", lambda d: _replaced(d, "teacher_logprobs", token_row(7, float("nan")))),
        "inf_log_prob": ("k3", lambda d: _replaced(d, "teacher_logprobs", token_row(2, float("-inf")))),
        "ids_k_disagree": ("topk", lambda d: _replaced(d, "teacher_ids", one_column)),
        "lengths_disagree": ("topk", other_lengths),
        "estimator_k": ("k3", lambda d: _replaced(d, "teacher_logprobs", lambda v: v.repeat(1, 4))),
        "missing_ids": ("topk", lambda d: d.exclude("teacher_ids")),
        "float_ids": ("topk", lambda d: _replaced(d, "teacher_ids", lambda v: v.float())),
    }  # fmt: skip
    said = {
        name: _outcome(functools.partial(run, case, tamper)).get("error") for name, (case, tamper) in tampers.items()
    }
    said["backend_verl"] = _outcome(
        lambda: token_step(batch("topk", False, True), engine.module[0], loss_function("topk"), "verl")
    ).get("error")
    return said


# ---------------------------------------------------------------- judging


def relative_error(want: torch.Tensor, got: torch.Tensor) -> float:
    if want.shape != got.shape:
        return float("inf")
    scale = float(want.double().abs().max()) if want.numel() else 0.0
    difference = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
    return difference / scale if scale > 0 else difference


def errors(want: dict, got: dict) -> dict[str, float]:
    """The worst relative error per quantity of `got` against `want` (inf where one side lacks something)."""
    worst = {"losses": 0.0, "metrics": 0.0, "outputs": 0.0, "grads": 0.0}
    if len(want["losses"]) != len(got["losses"]) or want["metrics"].keys() != got["metrics"].keys():
        return {key: float("inf") for key in worst}
    for w, g in zip(want["losses"], got["losses"]):
        worst["losses"] = max(worst["losses"], abs(g - w) / max(abs(w), 1e-7))
    for key, values in want["metrics"].items():
        for w, g in zip(values, got["metrics"][key], strict=True):
            worst["metrics"] = max(worst["metrics"], abs(g - w) / max(abs(w), 1e-7))
    if want["outputs"].keys() != got["outputs"].keys():
        worst["outputs"] = float("inf")
    for key, value in want["outputs"].items():
        worst["outputs"] = max(worst["outputs"], relative_error(value, got["outputs"].get(key, torch.empty(0))))
    if want["grads"].keys() != got["grads"].keys():
        worst["grads"] = float("inf")
    for name, grad in want["grads"].items():
        worst["grads"] = max(worst["grads"], relative_error(grad, got["grads"][name]))
    return worst


@functools.cache
def results(world_size: int) -> list[dict]:
    return run_in_processes(worker, world_size)


def assert_agrees(world_size: int, layout: str, case: str, side: str) -> dict[str, float]:
    worst = {}
    for rank, ranks in enumerate(results(world_size)):
        want, got = ranks[layout, case, UNFUSED], ranks[layout, case, side]
        found = errors(want, got)
        assert all(value <= RTOL for value in found.values()), (rank, layout, case, side, found)
        worst = {key: max(worst.get(key, 0.0), value) for key, value in found.items()}
    return worst


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", (1, 2))
@pytest.mark.parametrize("layout", ("thd", "bshd"))
@pytest.mark.parametrize("case", tuple(TOPK_CASES))
def test_topk_distillation_in_hook_mode_equals_verl_unfused(world_size, layout, case):
    worst = assert_agrees(world_size, layout, case, HOOK)
    print(f"TP={world_size} {layout} {case}: worst relative errors {worst}")
    for ranks in results(world_size):
        got = ranks[layout, case, HOOK]
        assert {"distillation/loss", "distillation/overlap_ratio", "distillation/student_mass"} <= set(got["metrics"])
        assert ("log_probs" in got["outputs"]) == (case != "topk-only")  # distillation_only: none, as verl's path
        assert set(OUTPUT_KEYS[2:]) <= set(got["outputs"])


@pytest.mark.parametrize("world_size", (1, 2))
def test_the_clamps_bind(world_size):
    """Both clamps act in the "topk" case: the losses' range (taken before loss_max_clamp) spans it, and the
    student's clamped log-probs change its top-k mass against the unclamped case."""
    from verl_fused_hook_harness.support.distillation import PRESETS

    loss_max_clamp = PRESETS["topk"]["loss_max_clamp"]
    for ranks in results(world_size):
        clamped, unclamped = ranks["thd", "topk", HOOK]["metrics"], ranks["thd", "topk-unclamped", HOOK]["metrics"]
        assert min(clamped["distillation/loss_min"]) < loss_max_clamp < max(clamped["distillation/loss_max"])
        assert clamped["distillation/student_mass"] != pytest.approx(unclamped["distillation/student_mass"], rel=1e-3)
        overlap = clamped["distillation/overlap_ratio"]
        assert 0 < min(overlap) and max(overlap) < 1  # some of the teacher's ids are the student's own top-k


def test_teacher_ids_cover_both_shards_and_repeat():
    data = batch("topk", False, True)
    ids = data["teacher_ids"].values()
    assert bool((ids < 512).any()) and bool((ids >= 512).any())
    assert bool((ids[:, 0] == ids[:, -1]).any())


@pytest.mark.parametrize("world_size", (1, 2))
@pytest.mark.parametrize("case", tuple(ESTIMATOR_CASES))
def test_estimator_losses_inside_the_op_equal_verl_unfused(world_size, case):
    worst = assert_agrees(world_size, "thd", case, HOOK_FUSED_LOSS)
    assert_agrees(world_size, "thd", case, HOOK)
    print(f"TP={world_size} {case} fused: worst relative errors {worst}")
    for ranks in results(world_size):
        assert ranks["thd", case, HOOK_FUSED_LOSS]["fused_forwards"] == 2  # both micro-batches, loss inside the op
        assert ranks["thd", case, HOOK]["fused_forwards"] == 0
        assert "distillation/abs_loss" in ranks["thd", case, HOOK_FUSED_LOSS]["metrics"]


def test_hook_mode_says_what_it_computes_and_scores_only_the_rows_verl_reads():
    (ranks,) = results(1)
    log = ranks["log"]
    assert any(
        line.startswith("verl_fused_hook: distillation_use_topk: verl's forward_kl_topk outputs") for line in log
    )
    assert any(line.startswith("verl_fused_hook: calculate_sum_pi_squared: sum_pi_squared from") for line in log)
    assert not any("score_mask off" in line for line in log), log


@pytest.mark.parametrize("world_size", (1, 2))
def test_topk_with_the_fused_loss_on_runs_the_two_pass_path_and_says_so(world_size):
    for case in TOPK_CASES:
        assert_agrees(world_size, "thd", case, HOOK_FUSED_LOSS)
    ranks = results(world_size)
    assert all(r["thd", case, HOOK_FUSED_LOSS]["fused_forwards"] == 0 for r in ranks for case in TOPK_CASES)
    assert any(
        "output_processor_fused_loss: distillation_ppo_loss(loss_mode=forward_kl_topk" in line
        and line.endswith("; two-pass path")
        for line in ranks[0]["log"]
    ), ranks[0]["log"]


@pytest.mark.parametrize("world_size", (1, 2))
@pytest.mark.parametrize("key", ("sum_pi_squared", "sum_pi_squared_bshd"))
def test_sum_pi_squared_in_hook_mode_equals_verls(world_size, key):
    for ranks in results(world_size):
        want, got = ranks[key, UNFUSED]["result"], ranks[key, HOOK]["result"]
        assert float(want.max()) > 0 and relative_error(want, got) <= RTOL, relative_error(want, got)
        print(f"TP={world_size} {key}: relative error {relative_error(want, got):.2e}")


def test_before_verls_fused_paths_fail_loudly():
    """What verl's own fused forward does (hook mode did the same before issue 43): no distillation outputs, so
    verl's final loss stops at its first read; sum pi^2 is refused outright."""
    (ranks,) = results(1)
    assert ranks["legacy", "topk"]["error"] == "KeyError: 'distillation_losses'"
    assert ranks["legacy", "sum_pi_squared"]["error"].startswith(
        "NotImplementedError: calculate_sum_pi_squared=True is not supported with use_fused_kernels=True"
    )


def test_verls_unfused_bshd_path_needs_micro_batches_padded_to_their_own_longest():
    """verl splits the teacher for its logits processor without the mini-batch padding it gives the logits."""
    (ranks,) = results(1)
    assert ranks["bshd", "verl_default_padding"]["error"].startswith("AssertionError")


BAD_INPUT_MESSAGES = {
    "id_past_vocabulary": "ValueError: teacher_ids: ids must lie in [0, 1024) (the student's vocabulary",
    "negative_id": "ValueError: teacher_ids: ids must lie in [0, 1024)",
    "nan_log_prob": "ValueError: teacher_logprobs: every teacher log-prob must be finite, found nan",
    "inf_log_prob": "ValueError: teacher_logprobs: every teacher log-prob must be finite, found -inf",
    "ids_k_disagree": "ValueError: teacher_ids: must hold k=16 values per token, got k=1",
    "lengths_disagree": "ValueError: teacher_ids: must hold one row of k entries per token of input_ids",
    "estimator_k": "ValueError: teacher_logprobs: must hold k=1 values per token, got k=4",
    "missing_ids": "ValueError: teacher_ids: the distillation loss reads it, but the batch has no teacher_ids",
    "float_ids": "ValueError: teacher_ids: must hold integer token ids, got torch.float32",
    "backend_verl": "ValueError: actor_rollout_ref.model.fused_kernel_options.output_processor_backend=verl cannot "
    "run a step with distillation_use_topk",
}


@pytest.mark.parametrize("name", tuple(BAD_INPUT_MESSAGES))
def test_bad_teacher_fields_stop_the_step_naming_the_field(name):
    (ranks,) = results(1)
    said = ranks["bad_inputs"][name]
    assert said is not None and said.startswith(BAD_INPUT_MESSAGES[name]), said


def test_no_dataclass_field_of_the_teacher_presets_is_misspelt():
    """Each preset entry is a field of verl's DistillationLossConfig (a typo would compose a config without it)."""
    from verl.workers.config import DistillationLossConfig

    from verl_fused_hook_harness.support.distillation import PRESETS

    fields = {field.name for field in dataclasses.fields(DistillationLossConfig)}
    for entries in (*PRESETS.values(), *ESTIMATOR_CASES.values()):
        assert set(entries) <= fields
