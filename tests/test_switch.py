"""The switch: VERL_FUSED_USE_OP_HOOK's three states and bad values, the config entries, and their precedence."""

from __future__ import annotations

import pytest

from verl_fused_hook.ops import BACKEND_CHOICES
from verl_fused_hook.switch import (
    ENV_VAR,
    HOOK,
    LEGACY,
    UNSET,
    parse_config_backend,
    parse_config_mode,
    parse_env,
    resolve_plan,
)


@pytest.mark.parametrize("raw, mode", [(None, None), ("1", HOOK), ("0", LEGACY), (" 1 ", HOOK)])
def test_env_states(raw, mode):
    environ = {} if raw is None else {ENV_VAR: raw}
    assert parse_env(environ) == mode


@pytest.mark.parametrize("raw", ["", "true", "yes", "2", "hook", "01"])
def test_env_bad_value_names_variable_and_allowed_values(raw):
    with pytest.raises(ValueError) as error:
        parse_env({ENV_VAR: raw})
    message = str(error.value)
    assert ENV_VAR in message and repr(raw) in message
    assert "use 1" in message and "0" in message and "unset" in message


def test_env_bad_value_fails_resolution_even_with_config():
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_plan({"use_output_processor_hook": True}, environ={ENV_VAR: "on"})


@pytest.mark.parametrize("value, mode", [(None, None), (True, HOOK), (False, LEGACY)])
def test_config_mode(value, mode):
    assert parse_config_mode({"use_output_processor_hook": value}) == mode
    assert parse_config_mode({}) is None and parse_config_mode(None) is None


@pytest.mark.parametrize("value", ["true", 1, 0, "1"])
def test_config_mode_rejects_non_bool(value):
    with pytest.raises(ValueError) as error:
        parse_config_mode({"use_output_processor_hook": value})
    message = str(error.value)
    assert "actor_rollout_ref.model.fused_kernel_options.use_output_processor_hook" in message
    assert "true, false or null" in message


def test_backends_are_the_ops_backends():
    assert {"verl", "auto", "torch"} <= set(BACKEND_CHOICES)
    for backend in BACKEND_CHOICES:
        assert parse_config_backend({"output_processor_backend": backend}) == backend


def test_config_backend_rejects_unknown():
    with pytest.raises(ValueError) as error:
        parse_config_backend({"output_processor_backend": "cuda"})
    message = str(error.value)
    assert "actor_rollout_ref.model.fused_kernel_options.output_processor_backend='cuda'" in message
    assert ", ".join(BACKEND_CHOICES) in message


def test_unset_everywhere_is_unset():
    plan = resolve_plan({}, environ={})
    assert (plan.mode, plan.backend, plan.is_set) == (UNSET, None, False)
    assert "left as verl ships it" in plan.log_line("E")


def test_env_wins_over_config_and_says_so():
    plan = resolve_plan({"use_output_processor_hook": True}, environ={ENV_VAR: "0"})
    assert plan.mode == LEGACY and plan.source == f"{ENV_VAR}=0"
    assert (
        plan.note == f"{ENV_VAR} overrides actor_rollout_ref.model.fused_kernel_options.use_output_processor_hook=True"
    )
    plan = resolve_plan({"use_output_processor_hook": False}, environ={ENV_VAR: "1"})
    assert plan.mode == HOOK and "overrides" in plan.note


def test_agreeing_sources_add_no_note():
    plan = resolve_plan({"use_output_processor_hook": True}, environ={ENV_VAR: "1"})
    assert plan.mode == HOOK and plan.note is None


def test_config_alone_sets_mode_and_backend():
    plan = resolve_plan({"use_output_processor_hook": True, "output_processor_backend": "torch"}, environ={})
    assert (plan.mode, plan.backend) == (HOOK, "torch")
    assert plan.source == "actor_rollout_ref.model.fused_kernel_options.use_output_processor_hook=true"
    line = plan.log_line("MegatronEngineWithLMHead")
    assert line == (
        "verl_fused_hook: MegatronEngineWithLMHead uses the output_processor hook, backend=torch "
        "(actor_rollout_ref.model.fused_kernel_options.use_output_processor_hook=true)"
    )


def test_hook_mode_defaults_to_auto_backend():
    assert resolve_plan({}, environ={ENV_VAR: "1"}).backend == "auto"


def test_backend_outside_hook_mode_is_ignored_with_a_note():
    plan = resolve_plan({"output_processor_backend": "verl"}, environ={ENV_VAR: "0"})
    assert (plan.mode, plan.backend) == (LEGACY, None)
    assert (
        plan.note
        == "actor_rollout_ref.model.fused_kernel_options.output_processor_backend=verl ignored outside hook mode"
    )
    assert "legacy fused forward" in plan.log_line("E") and plan.note in plan.log_line("E")


def test_bad_backend_fails_even_when_unused():
    with pytest.raises(ValueError, match="output_processor_backend"):
        resolve_plan({"output_processor_backend": "nope"}, environ={})


def test_reads_process_environment_by_default(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    assert resolve_plan({}).mode == HOOK
    monkeypatch.delenv(ENV_VAR)
    assert resolve_plan({}).mode == UNSET


def test_score_mask_entry_defaults_on_and_turns_off_in_hook_mode():
    assert resolve_plan({}, environ={ENV_VAR: "1"}).score_mask is True
    plan = resolve_plan({"output_processor_score_mask": False}, environ={ENV_VAR: "1"})
    assert plan.score_mask is False
    assert plan.log_line("E").endswith("output_processor_score_mask=false")


def test_score_mask_entry_outside_hook_mode_is_ignored_with_a_note():
    plan = resolve_plan({"output_processor_score_mask": False}, environ={ENV_VAR: "0"})
    assert (
        plan.note
        == "actor_rollout_ref.model.fused_kernel_options.output_processor_score_mask ignored outside hook mode"
    )


@pytest.mark.parametrize("value", ["false", 0, 1])
def test_score_mask_entry_rejects_non_bool(value):
    with pytest.raises(ValueError) as error:
        resolve_plan({"output_processor_score_mask": value}, environ={ENV_VAR: "1"})
    message = str(error.value)
    assert f"actor_rollout_ref.model.fused_kernel_options.output_processor_score_mask={value!r}" in message
    assert "true, false or null (on)" in message


def test_keep_logits_entry_in_hook_mode_reaches_the_plan_in_bytes():
    assert resolve_plan({}, environ={ENV_VAR: "1"}).keep_logits_bytes == 0
    plan = resolve_plan({"output_processor_keep_logits_gib": 1.5}, environ={ENV_VAR: "1"})
    assert plan.keep_logits_bytes == 3 * 2**29
    assert plan.log_line("E").endswith("output_processor_keep_logits_gib=1.5")


def test_keep_logits_entry_outside_hook_mode_is_ignored_with_a_note():
    plan = resolve_plan({"output_processor_keep_logits_gib": 4}, environ={ENV_VAR: "0"})
    assert plan.keep_logits_bytes == 0
    assert (
        plan.note
        == "actor_rollout_ref.model.fused_kernel_options.output_processor_keep_logits_gib ignored outside hook mode"
    )


@pytest.mark.parametrize("value", [0, -1, "4", True, float("inf")])
def test_keep_logits_entry_rejects_what_is_not_a_positive_number_of_gib(value):
    with pytest.raises(ValueError) as error:
        resolve_plan({"output_processor_keep_logits_gib": value}, environ={ENV_VAR: "1"})
    assert str(error.value) == (
        f"actor_rollout_ref.model.fused_kernel_options.output_processor_keep_logits_gib={value!r} is not allowed; use "
        f"a "
        "number of GiB > 0 (the logits the op keeps for its backward, e.g. 4) or null (none: recompute them)"
    )


@pytest.mark.parametrize("backend", ["torch", "verl"])
def test_keep_logits_entry_with_a_backend_that_recomputes_stops_at_start_up(backend):
    with pytest.raises(
        ValueError,
        match=(
            rf"output_processor_keep_logits_gib needs a backend that keeps logits: "
            rf"actor_rollout_ref.model.fused_kernel_options.output_processor_backend={backend} recomputes them; "
            r"use output_processor_backend=auto or triton"
        ),
    ):
        resolve_plan(
            {"output_processor_keep_logits_gib": 2, "output_processor_backend": backend}, environ={ENV_VAR: "1"}
        )


@pytest.mark.parametrize(
    "key, nearest",
    [
        ("output_processor_fused_los", "output_processor_fused_loss"),  # one letter short
        ("output_processor_backends", "output_processor_backend"),
        ("output_processor_chunk_gib", "output_processor_fused_loss_chunk_gib"),  # our namespace, far from every key
        ("use_output_processor", "use_output_processor_hook"),
        ("use_output_procesor_hook", "use_output_processor_hook"),  # a near miss outside the namespace
    ],
)
def test_unknown_or_misspelt_key_stops_with_the_nearest_and_the_allowed_keys(key, nearest):
    with pytest.raises(ValueError) as error:
        resolve_plan({key: True}, environ={})
    message = str(error.value)
    assert message.startswith(f"actor_rollout_ref.model.fused_kernel_options.{key} is not a verl_fused_hook entry")
    assert f"did you mean actor_rollout_ref.model.fused_kernel_options.{nearest}?" in message
    assert (
        "allowed: use_output_processor_hook, output_processor_backend, output_processor_fused_loss, "
        "output_processor_fused_loss_chunk_gib, output_processor_score_mask, output_processor_keep_logits_gib"
    ) in message


def test_verls_own_keys_are_left_alone():
    plan = resolve_plan({"impl_backend": "triton", "use_output_processor_hook": True}, environ={})
    assert plan.mode == HOOK


def test_edit_distance():
    from verl_fused_hook.switch import edit_distance

    assert [edit_distance(a, b) for a, b in (("", "ab"), ("kitten", "sitting"), ("loss", "los"), ("ab", "ab"))] == [
        2,
        3,
        1,
        0,
    ]


def test_batch_invariant_entry_in_hook_mode_reaches_the_plan():
    assert resolve_plan({}, environ={ENV_VAR: "1"}).batch_invariant is False
    plan = resolve_plan({"output_processor_batch_invariant": True}, environ={ENV_VAR: "1"})
    assert plan.batch_invariant is True
    assert plan.log_line("E").endswith("output_processor_batch_invariant=true")
    off = resolve_plan({"output_processor_batch_invariant": True}, environ={ENV_VAR: "0"})
    assert off.batch_invariant is False
    assert off.note == (
        "actor_rollout_ref.model.fused_kernel_options.output_processor_batch_invariant=true ignored outside hook mode"
    )


@pytest.mark.parametrize("value", [1, "true"])
def test_batch_invariant_entry_must_be_a_bool(value):
    with pytest.raises(ValueError) as error:
        resolve_plan({"output_processor_batch_invariant": value}, environ={ENV_VAR: "1"})
    assert str(error.value) == (
        f"actor_rollout_ref.model.fused_kernel_options.output_processor_batch_invariant={value!r} is not allowed; "
        "use true, false or null (off)"
    )
