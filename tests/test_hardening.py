"""Issue 11: every bad input a clear error, the plugin never silently off, the op in fp32 under autocast.

Each test here was seen to fail on the code before the fix (see the commit message).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from verl_fused_hook import FusedOutputProcessorContext, fused_output_processor, log_probs_and_entropy
from verl_fused_hook.verl_integration import log_level_from_env
from verl_fused_hook.verl_integration.lazy_import import when_imported
from verl_fused_hook.verl_integration.replacements import _originals, original, replace, restore
from verl_fused_hook_harness.support import compare
from verl_fused_hook_harness.support.distributed import run_in_processes
from verl_fused_hook_harness.support.reference import reference_log_probs_entropy

REPO = Path(__file__).resolve().parents[1]
FP32_REL = 2e-6  # fp32 op vs fp64 reference, H=32 V=96


def _problem(n=6, h=32, v=96, seed=0, requires_grad=True):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=generator).requires_grad_(requires_grad)
    weight = (torch.randn(v, h, generator=generator) / h**0.5).requires_grad_(requires_grad)
    labels = torch.randint(0, v, (n,), generator=generator)
    return hidden, weight, labels


# ---------------------------------------------------------------- the plugin is never silently off

IMPORT_VERL = textwrap.dedent(
    """
    import json, logging, sys
    import verl  # loads the plugin through verl's entry points, as every verl process does
    from verl_fused_hook.verl_integration.lazy_import import _AfterImportFinder
    gated = [f.name for f in sys.meta_path if isinstance(f, _AfterImportFinder)]
    level = logging.getLevelName(logging.getLogger("verl_fused_hook").level)
    print("STATE " + json.dumps({"gated": gated, "level": level}))
    """
)


def _import_verl(**env: str) -> tuple[dict, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("VERL_FUSED_")}
    environ.update(env, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_VERL], env=environ, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    state = next(line for line in result.stdout.splitlines() if line.startswith("STATE "))
    return json.loads(state[len("STATE ") :]), result.stderr


@pytest.mark.parametrize("raw", ["verbose", "10"])
def test_bad_logging_level_falls_back_to_info_with_one_warning(raw):
    state, stderr = _import_verl(VERL_FUSED_HOOK_LOGGING_LEVEL=raw, VERL_FUSED_USE_OP_HOOK="1")
    assert state["level"] == "INFO"
    assert "verl.workers.engine.megatron.transformer_impl" in state["gated"]  # the plugin installed its gate
    warnings = [line for line in stderr.splitlines() if "VERL_FUSED_HOOK_LOGGING_LEVEL" in line]
    assert len(warnings) == 1, stderr
    assert (
        repr(raw) in warnings[0]
        and "DEBUG, INFO, WARNING, ERROR, CRITICAL" in warnings[0]
        and "using INFO" in warnings[0]
    )


@pytest.mark.parametrize("raw, level", [("debug", "DEBUG"), (" Warning ", "WARNING"), (None, "INFO")])
def test_good_logging_levels(raw, level):
    environ = {} if raw is None else {"VERL_FUSED_HOOK_LOGGING_LEVEL": raw}
    assert log_level_from_env(environ) == (level, None)


def test_bad_switch_value_is_logged_once_at_import_verl():
    state, stderr = _import_verl(VERL_FUSED_USE_OP_HOOK="yes")
    lines = [line for line in stderr.splitlines() if "VERL_FUSED_USE_OP_HOOK='yes' is not allowed" in line]
    assert len(lines) == 1, stderr
    assert "verl.workers.engine.megatron.transformer_impl" in state["gated"]


def test_replace_changes_nothing_when_the_factory_raises():
    owner = types.ModuleType("vfh_owner")  # a module, like the verl modules the plugin replaces attributes of
    owner.function = len

    def failing_factory(_original):
        raise RuntimeError("factory failed")

    with pytest.raises(RuntimeError, match="factory failed"):
        replace(owner, "function", failing_factory)
    assert owner.function is len and (owner, "function") not in _originals
    replace(owner, "function", lambda verl_function: lambda value: verl_function(value) + 1)  # the retry replaces
    try:
        assert owner.function("abc") == 4 and original(owner, "function") is len
    finally:
        restore()
    assert owner.function is len


def test_lazy_import_callback_failure_fails_the_import_and_the_retry_runs_it(tmp_path, monkeypatch):
    (tmp_path / "vfh_lazy_target.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []

    def callback(module):
        calls.append(module.VALUE)
        if len(calls) == 1:
            raise RuntimeError("callback failed")

    when_imported("vfh_lazy_target", callback)
    try:
        with pytest.raises(RuntimeError, match="callback failed"):
            import vfh_lazy_target  # noqa: F401
        assert "vfh_lazy_target" not in sys.modules
        import vfh_lazy_target  # noqa: F401, F811  (the second import runs the callback again)

        assert calls == [1, 1]
        assert not any(getattr(f, "name", None) == "vfh_lazy_target" for f in sys.meta_path)  # one shot once it ran
    finally:
        sys.modules.pop("vfh_lazy_target", None)
        sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "name", None) != "vfh_lazy_target"]


# ---------------------------------------------------------------- the op: fp32 under autocast, once differentiable


def test_op_computes_in_fp32_under_cpu_autocast():
    hidden, weight, labels = _problem()
    generator = torch.Generator().manual_seed(1)
    g_lp, g_h = torch.randn(6, generator=generator), torch.randn(6, generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        log_probs, entropy = log_probs_and_entropy(hidden, weight, labels, temperature=0.7, backend="torch")
        (log_probs * g_lp + entropy * g_h).sum().backward()
    ref_lp, ref_h, ref_dh, ref_dw = reference_log_probs_entropy(
        hidden, weight, labels, temperature=0.7, grad_outputs=(g_lp, g_h)
    )
    assert log_probs.dtype == torch.float32
    for name, got, want in (
        ("log_probs", log_probs, ref_lp),
        ("entropy", entropy, ref_h),
        ("d_hidden", hidden.grad, ref_dh),
        ("d_weight", weight.grad, ref_dw),
    ):
        assert compare.error(want, got.detach(), relative=True) < FP32_REL, name


def test_second_order_gradients_raise():
    hidden, weight, labels = _problem()
    log_probs, entropy = log_probs_and_entropy(hidden, weight, labels, backend="torch")
    (d_hidden,) = torch.autograd.grad((log_probs + entropy).sum(), hidden, create_graph=True)
    assert not d_hidden.requires_grad  # no graph through the backward: a second backward is refused
    with pytest.raises(RuntimeError, match="does not require grad"):
        d_hidden.sum().backward()
    g_log_probs = torch.ones(6, requires_grad=True)  # grad outputs in the graph: torch names the reason
    (d_hidden,) = torch.autograd.grad(log_probs, hidden, grad_outputs=g_log_probs, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        d_hidden.sum().backward()


# ---------------------------------------------------------------- the op: every bad input a ValueError naming it


def _bad_op_inputs():
    hidden, weight, labels = _problem(requires_grad=False)
    return [
        ("ignore_index", dict(ignore_index=None)),
        ("ignore_index", dict(ignore_index=1.5)),
        ("labels", dict(labels=labels.tolist())),
        ("labels", dict(labels=labels.to(torch.float8_e4m3fn))),
        ("labels", dict(labels=labels.to(torch.complex64))),
        ("score_mask", dict(score_mask=[True] * 6)),
        ("score_mask", dict(score_mask=torch.ones(6, dtype=torch.bool, device="meta"))),
        ("hidden", dict(hidden=torch.zeros(6, 0), weight=torch.zeros(96, 0))),
        ("temperature", dict(temperature=1 + 1j)),
        ("temperature", dict(temperature=torch.full((6,), 1 + 1j))),
        ("temperature", dict(temperature=torch.ones(6, dtype=torch.bool))),
        ("temperature", dict(temperature=torch.ones(6, device="meta"))),
        ("temperature", dict(temperature=torch.ones(6, requires_grad=True))),
        ("calculate_entropy", dict(calculate_entropy=1)),
        ("calculate_entropy", dict(calculate_entropy="no")),
    ], (hidden, weight, labels)


BAD_OP_INPUTS, BASE = _bad_op_inputs()


@pytest.mark.parametrize("field, override", BAD_OP_INPUTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_OP_INPUTS)])
def test_op_bad_input_is_a_value_error_naming_the_argument(field, override):
    arguments = dict(zip(("hidden", "weight", "labels"), BASE))
    arguments.update(override)
    hidden, weight, labels = arguments.pop("hidden"), arguments.pop("weight"), arguments.pop("labels")
    with pytest.raises(ValueError) as error:
        log_probs_and_entropy(hidden, weight, labels, backend="torch", **arguments)
    assert str(error.value).startswith(field), str(error.value)


def _mismatched_rows_worker(rank, world_size):
    hidden, weight, labels = _problem(n=4 + 2 * rank, requires_grad=False)
    group = torch.distributed.new_group(list(range(world_size)))
    try:
        log_probs_and_entropy(hidden, weight[:48], labels % 48, tp_group=group, backend="torch")
    except ValueError as error:
        return str(error)
    return None


def test_tp_ranks_with_different_row_counts_get_an_error_not_a_hang():
    messages = run_in_processes(_mismatched_rows_worker, 2)
    for message in messages:
        assert message is not None and message.startswith("hidden/labels/score_mask")
        assert "rank 0: 4 rows (4 scored), rank 1: 6 rows (6 scored)" in message


# ---------------------------------------------------------------- the processor


def _processor_inputs(b=2, s=3, h=16, v=40, bias=False):
    generator = torch.Generator().manual_seed(3)
    output_layer = torch.nn.Linear(h, v, bias=bias)
    hidden_states = torch.randn(s, b, h, generator=generator)
    labels = torch.randint(0, v, (b, s), generator=generator)
    return dict(hidden_states=hidden_states, output_layer=output_layer, labels=labels)


def test_processor_refuses_a_biased_output_layer():
    with pytest.raises(ValueError) as error:
        fused_output_processor(**_processor_inputs(bias=True))
    assert str(error.value).startswith("output_layer (Linear) has a bias")
    output = fused_output_processor(**_processor_inputs(bias=False))  # the bias-free layer runs
    assert output.log_probs.shape == (2, 3)


def test_processor_score_mask_message_names_the_shapes_as_given():
    context = FusedOutputProcessorContext(score_mask=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(ValueError) as error:
        fused_output_processor(**_processor_inputs(), context=context)
    assert str(error.value) == (
        "FusedOutputProcessorContext.score_mask: must be shaped like labels [b, s] = (2, 3), got (3, 2)"
    )


@pytest.mark.parametrize("shape", [(3,), (2, 4), (3, 2)])
def test_processor_wrong_shape_temperature_is_a_value_error(shape):
    context = FusedOutputProcessorContext(temperature=torch.ones(shape))
    with pytest.raises(
        ValueError, match=r"^FusedOutputProcessorContext\.temperature: a tensor must be 0-d, \[b\] = \(2,\)"
    ):
        fused_output_processor(**_processor_inputs(), context=context)


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("temperature", dict(temperature=torch.ones(2, dtype=torch.bool))),
        ("temperature", dict(temperature=torch.ones(2, device="meta"))),
        ("temperature", dict(temperature=torch.full((2,), 1 + 1j))),
        ("temperature", dict(temperature=torch.ones(2, requires_grad=True))),
        ("score_mask", dict(score_mask=torch.ones(2, 3, dtype=torch.bool, device="meta"))),
        ("calculate_entropy", dict(calculate_entropy=1)),
    ],
)
def test_context_bad_field_is_a_value_error_naming_it(field, kwargs):
    with pytest.raises(ValueError, match=rf"^FusedOutputProcessorContext\.{field}"):
        FusedOutputProcessorContext(**kwargs)


def test_logging_level_is_read_once_per_install(caplog):
    """install() never raises for a bad level (verl's loader would hide it): it logs and goes on."""
    from verl_fused_hook.verl_integration import install

    package_logger = logging.getLogger("verl_fused_hook")
    level_before = package_logger.level
    caplog.set_level(logging.WARNING, logger="verl_fused_hook")
    os.environ["VERL_FUSED_HOOK_LOGGING_LEVEL"] = "loud"
    try:
        install()
        install()
        assert package_logger.level == logging.INFO
    finally:
        del os.environ["VERL_FUSED_HOOK_LOGGING_LEVEL"]
        package_logger.setLevel(level_before)
    assert [r.getMessage() for r in caplog.records].count(
        "verl_fused_hook: VERL_FUSED_HOOK_LOGGING_LEVEL='loud' is not a level; use one of DEBUG, INFO, WARNING, "
        "ERROR, CRITICAL; using INFO"
    ) == 1


def test_tp_group_that_is_not_a_group_is_a_value_error_with_torch_distributed_up():
    """With a process group initialized (as in any trainer), a stray object must not reach torch.distributed."""
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel

    init_model_parallel(1)
    hidden, weight, labels = _problem(requires_grad=False)
    with pytest.raises(ValueError, match="^tp_group: expected a torch.distributed ProcessGroup or None, got object"):
        log_probs_and_entropy(hidden, weight, labels, tp_group=object())
