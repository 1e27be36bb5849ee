"""The verl plugin on real verl 0.9.1 and real megatron-core 0.19.2 GPTModels on the CPU.

Every test drives verl's own objects: `MegatronEngine._maybe_enable_fused_kernels`
(the build step), `MegatronEngineWithLMHead.forward_step`, the engine forward
that `verl.models.mcore.get_mcore_forward_fused_model_engine_fn` returns, and
verl's MTP `patch_postprocess`. The legacy side runs verl's
`_fused_GPTModel_forward` with its kernel swapped for the portable op (verl's
Triton kernel needs CUDA), so legacy and hook share one kernel and agree exactly.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest
import torch
from output_rows import OutputWeightRows

from verl_fused_hook.probe import OutputProcessorUnsupportedError
from verl_fused_hook.switch import ENV_VAR
from verl_fused_hook.verl_integration import call_sites, install
from verl_fused_hook_harness.stand_ins.legacy_kernel_swap import portable_legacy_kernel
from verl_fused_hook_harness.stand_ins.megatron_cpu import build_cpu_gpt, init_model_parallel, tiny_transformer_config
from verl_fused_hook_harness.support.verl_engine import fused_engine_forward, megatron_engine

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 192  # no other layer of the tiny model has 192 output features, so output-weight matmuls are countable
PROMPT_LENS = (4, 6, 3)
RESPONSE_LENS = (5, 2, 7)
EXACT = dict(rtol=0, atol=0)
CLOSE = dict(rtol=0, atol=1e-6)  # fp32, same kernel, different row subsets/tiles

install()
import verl.models.mcore as mcore  # noqa: E402
import verl.workers.engine.megatron.transformer_impl as transformer_impl  # noqa: E402  (fires install's gate)
from megatron.core.models.gpt import GPTModel  # noqa: E402
from verl.models.mcore import model_forward_fused, mtp_patch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402


def verl_call_sites():
    """The objects verl's fused path looks up at call time (the build gate is listed separately)."""
    return {
        "patch_fused_forward": model_forward_fused.patch_fused_forward,
        "get_mcore_forward_fused_model_engine_fn": mcore.get_mcore_forward_fused_model_engine_fn,
        "patch_postprocess": mtp_patch.patch_postprocess,
        "_resolve_fused_temperature": transformer_impl._resolve_fused_temperature,
        "forward_step": transformer_impl.MegatronEngineWithLMHead.forward_step,
        "GPTModel.forward": GPTModel.forward,
    }


ORIGINALS = verl_call_sites()


@pytest.fixture(scope="module", autouse=True)
def model_parallel():
    init_model_parallel(1)


@pytest.fixture(autouse=True)
def clean_verl(monkeypatch):
    """Each test starts with verl's call sites as verl ships them (the build gate stays) and no switch."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    yield
    call_sites.restore()
    call_sites.install_build_gate(transformer_impl)


def tiny_model(*, tied=False, mtp_num_layers=None, seed=7):
    return build_cpu_gpt(tiny_transformer_config(mtp_num_layers=mtp_num_layers), vocab_size=VOCAB, tied=tied, seed=seed)


def nested(parts):
    return torch.nested.as_nested_tensor(list(parts), layout=torch.jagged)


def rl_batch(temperature):
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator) for n in PROMPT_LENS]
    responses = [torch.randint(0, VOCAB, (n,), generator=generator) for n in RESPONSE_LENS]
    loss_mask = [torch.cat([torch.zeros(len(p)), torch.ones(len(r))]).long() for p, r in zip(prompts, responses)]
    return tu.get_tensordict(
        {
            "input_ids": nested(torch.cat(pair) for pair in zip(prompts, responses)),
            "loss_mask": nested(loss_mask),
            "prompts": nested(prompts),
            "responses": nested(responses),
            "temperature": torch.as_tensor(temperature, dtype=torch.float32).expand(len(PROMPT_LENS)).clone(),
        },
        non_tensor_dict={"calculate_entropy": True},
    )


def engine_forward(engine, model, batch, temperature=0.7):
    return fused_engine_forward(engine, model, batch["input_ids"], temperature)


def forward_step(engine, model, batch, loss_function=None):
    output, _ = engine.forward_step(iter([batch]), model, loss_function, lambda output, **_: output)
    return output


def built(options=None, **model_kwargs):
    model = tiny_model(**model_kwargs)
    engine = megatron_engine([model], fused_kernel_options=options)
    engine._maybe_enable_fused_kernels()
    return engine, model


# ---------------------------------------------------------------- the switch at verl's build step


def test_unset_leaves_every_verl_function_untouched(caplog):
    caplog.set_level(logging.INFO, logger="verl_fused_hook")
    engine, model = built()
    assert verl_call_sites() == ORIGINALS
    assert all(verl_call_sites()[name] is ORIGINALS[name] for name in ORIGINALS)
    assert not any(hasattr(function, "__wrapped__") for function in ORIGINALS.values())  # none is one of ours
    assert "forward" not in model.__dict__  # verl picked its own hook path: no monkey patch
    assert model._verl_fused_forward_mode == "hook" and not hasattr(model, "_verl_fused_hook_plan")
    assert "MegatronEngineWithLMHead left as verl ships it" in caplog.text


def test_hook_mode_build_uses_the_probe_and_keeps_forward(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="verl_fused_hook")
    monkeypatch.setenv(ENV_VAR, "1")
    engine, model = built({"output_processor_backend": "torch"})
    assert "forward" not in model.__dict__ and not hasattr(model, "forward_backup")
    assert model._verl_fused_forward_mode == "hook" and model._verl_fused_hook_plan.backend == "torch"
    assert (
        "MegatronEngineWithLMHead uses the output_processor hook, backend=torch (VERL_FUSED_USE_OP_HOOK=1)"
        in caplog.text
    )


def test_legacy_mode_forces_verl_monkey_patch_even_with_hook_support(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="verl_fused_hook")
    monkeypatch.setenv(ENV_VAR, "0")
    engine, model = built({"use_output_processor_hook": True})
    assert model._verl_fused_forward_mode == "legacy"
    assert model.forward.__func__ is model_forward_fused._fused_GPTModel_forward
    overridden = "actor_rollout_ref.model.fused_kernel_options.use_output_processor_hook=True"
    assert f"VERL_FUSED_USE_OP_HOOK overrides {overridden}" in caplog.text


def test_config_entry_alone_turns_hook_mode_on():
    engine, model = built({"use_output_processor_hook": True, "output_processor_backend": "torch"})
    assert model._verl_fused_hook_plan.mode == "hook" and "forward" not in model.__dict__


def test_bad_switch_value_stops_the_build(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "yes")
    model = tiny_model()
    with pytest.raises(ValueError, match="VERL_FUSED_USE_OP_HOOK='yes' is not allowed; use 1"):
        megatron_engine([model])._maybe_enable_fused_kernels()


@pytest.mark.parametrize("switch", [None, "1"])
def test_misspelt_entry_stops_the_build_even_with_the_switch_unset(monkeypatch, switch):
    if switch is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, switch)
    model = tiny_model()
    engine = megatron_engine(
        [model], fused_kernel_options={"output_processor_fused_los": True, "impl_backend": "triton"}
    )
    with pytest.raises(
        ValueError,
        match=r"fused_kernel_options\.output_processor_fused_los is not a verl_fused_hook "
        r"entry; did you mean actor_rollout_ref\.model\.fused_kernel_options\.output_processor_fused_loss\?",
    ):
        engine._maybe_enable_fused_kernels()
    assert not hasattr(model, "_verl_fused_hook_plan")


def test_verl_backend_without_cuda_stops_the_build(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    model = tiny_model()
    engine = megatron_engine([model], fused_kernel_options={"output_processor_backend": "verl"})
    with pytest.raises(
        ValueError, match=r"output_processor_backend=verl cannot run here: hidden: verl's kernel needs "
    ):
        engine._maybe_enable_fused_kernels()
    assert not hasattr(model, "_verl_fused_hook_plan")


def test_portable_backend_with_batch_invariance_stops_the_build_on_a_cuda_machine(monkeypatch):
    """On a CUDA machine the portable backend cannot promise batch invariance, so verl's build stops, naming both
    entries. FAKE, named: `torch.cuda.is_available` answers True while the build step runs (the check reads only
    the device type; the tiny model stays on the CPU). On the CPU the same entries build (the backend is invariant
    there)."""
    monkeypatch.setenv(ENV_VAR, "1")
    options = {"output_processor_backend": "torch", "output_processor_batch_invariant": True}
    model = tiny_model()
    engine = megatron_engine([model], fused_kernel_options=options)
    with monkeypatch.context() as cuda_machine:
        cuda_machine.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.raises(
            ValueError,
            match=r"fused_kernel_options\.output_processor_backend=torch with actor_rollout_ref\.model\."
            r"fused_kernel_options\.output_processor_batch_invariant=true cannot run here: batch_invariant=True: "
            r"on CUDA the portable backend's cuBLAS GEMMs",
        ):
            engine._maybe_enable_fused_kernels()
    cpu_model = tiny_model()
    megatron_engine([cpu_model], fused_kernel_options=options)._maybe_enable_fused_kernels()
    assert cpu_model._verl_fused_hook_plan.batch_invariant and cpu_model._verl_fused_hook_plan.backend == "torch"


class _GPTWithoutHook(GPTModel):
    """A GPTModel as megatron-core < 0.18 shipped it: forward without the hook parameters."""

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, **kwargs):
        return super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, labels=labels)


def test_megatron_without_hook_fails_at_build_instead_of_falling_back(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    model = tiny_model()
    model.__class__ = _GPTWithoutHook
    with pytest.raises(OutputProcessorUnsupportedError, match=r"megatron-core>=0.18.0 \(upstream PR 4686\)"):
        megatron_engine([model])._maybe_enable_fused_kernels()
    assert "forward" not in model.__dict__  # no silent legacy patch


def test_mtp_in_hook_mode_on_megatron_core_0_18_is_refused_at_build_by_name(monkeypatch):
    """megatron-core 0.18.x has the hook but neither name the fused MTP loss reads: the build stops naming both,
    instead of an AttributeError at the first training step."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from verl_fused_hook.probe import installed_megatron_version

    monkeypatch.setenv(ENV_VAR, "1")
    monkeypatch.delattr(MTPLossLoggingHelper, "save_metrics_to_tracker")
    model = tiny_model(mtp_num_layers=1)
    engine = megatron_engine([model], mtp_enable=True, mtp_enable_train=True)
    fields_of_0_18 = {name: value for name, value in vars(model.config).items() if name != "mtp_detach_heads"}
    engine.tf_config = types.SimpleNamespace(**fields_of_0_18)
    with pytest.raises(OutputProcessorUnsupportedError) as refused:
        engine._maybe_enable_fused_kernels()
    assert str(refused.value) == (
        "hook mode on an MTP model needs megatron-core>=0.19.0 for TransformerConfig.mtp_detach_heads and "
        f"MTPLossLoggingHelper.save_metrics_to_tracker; installed megatron-core is {installed_megatron_version()}. "
        "Upgrade with `pip install 'megatron-core>=0.19.0'`, or set VERL_FUSED_USE_OP_HOOK=0 to keep verl's path "
        "(fused kernels off with MTP)"
    )
    assert not hasattr(model, "_verl_fused_hook_plan")


def test_switch_without_fused_kernels_has_no_effect_and_says_so(monkeypatch, caplog):
    monkeypatch.setenv(ENV_VAR, "1")
    model = tiny_model()
    megatron_engine([model], use_fused_kernels=False)._maybe_enable_fused_kernels()
    assert not hasattr(model, "_verl_fused_hook_plan")
    assert "use_fused_kernels is False, so the switch has no effect" in caplog.text


# ---------------------------------------------------------------- forward: parity, temperatures, score mask


@pytest.mark.parametrize("tied", [False, True])
def test_hook_forward_equals_legacy_forward_exactly(monkeypatch, tied):
    batch = rl_batch(0.7)
    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(ENV_VAR, mode)
        engine, model = built({"output_processor_backend": "torch"}, tied=tied)
        with portable_legacy_kernel("torch"):
            output = engine_forward(engine, model, batch)
        (output["log_probs"].values().sum() - output["entropy"].values().mean()).backward()
        results[mode] = (output, {n: p.grad for n, p in model.named_parameters()})
    (legacy, legacy_grads), (hook, hook_grads) = results["0"], results["1"]
    torch.testing.assert_close(hook["log_probs"].values(), legacy["log_probs"].values(), **EXACT)
    torch.testing.assert_close(hook["entropy"].values(), legacy["entropy"].values(), **EXACT)
    for name in legacy_grads:
        torch.testing.assert_close(hook_grads[name], legacy_grads[name], **EXACT, msg=name)


def test_keep_logits_entry_reaches_the_op_through_the_engine(monkeypatch, caplog):
    """output_processor_keep_logits_gib travels plan -> engine forward -> context -> op. On the CPU "auto" runs the
    portable backend, which recomputes: the op's one log line is the evidence, and the numbers do not move."""
    from verl_fused_hook import log_once
    from verl_fused_hook.ops import two_pass

    monkeypatch.setenv(ENV_VAR, "1")
    monkeypatch.setattr(log_once, "_said", set())  # nothing said yet
    batch = rl_batch(0.7)
    outputs = []
    for options in ({}, {"output_processor_keep_logits_gib": 1}):
        engine, model = built(options)
        with caplog.at_level(logging.INFO, logger=two_pass.__name__):
            outputs.append(engine_forward(engine, model, batch))
    assert [r.getMessage() for r in caplog.records if r.name == two_pass.__name__] == [
        "log_probs_and_entropy: keep_logits_bytes=1073741824 ignored: backend 'torch' recomputes every row's logits "
        "(only 'triton' keeps them)"
    ]
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(outputs[1][key].values(), outputs[0][key].values(), **EXACT)


def test_mixed_temperatures_pass_through_forward_step(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    engine, model = built({"output_processor_backend": "torch"})
    mixed = forward_step(engine, model, rl_batch([0.7, 1.0, 0.5]), loss_function=partial_sft())
    for index, temperature in enumerate((0.7, 1.0, 0.5)):
        uniform = forward_step(engine, model, rl_batch([temperature] * 3), loss_function=partial_sft())
        torch.testing.assert_close(mixed["log_probs"][index], uniform["log_probs"][index], **CLOSE)
        torch.testing.assert_close(mixed["entropy"][index], uniform["entropy"][index], **CLOSE)
    at_one = forward_step(engine, model, rl_batch([1.0] * 3), partial_sft())
    assert not torch.allclose(mixed["log_probs"][0], at_one["log_probs"][0])  # the temperature did matter


def test_mixed_temperatures_still_raise_in_legacy_mode(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "0")
    engine, model = built()
    with pytest.raises(NotImplementedError, match="uniform temperature"):
        forward_step(engine, model, rl_batch([0.7, 1.0, 0.5]))


def test_engine_forward_accepts_per_sample_temperature_tensor(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    engine, model = built({"output_processor_backend": "torch"})
    batch = rl_batch(1.0)
    per_sample = engine_forward(engine, model, batch, temperature=torch.tensor([0.5, 0.5, 2.0]))
    at_half = engine_forward(engine, model, batch, temperature=0.5)
    at_two = engine_forward(engine, model, batch, temperature=2.0)
    torch.testing.assert_close(per_sample["log_probs"][1], at_half["log_probs"][1], **CLOSE)
    torch.testing.assert_close(per_sample["log_probs"][2], at_two["log_probs"][2], **CLOSE)


def partial_sft():
    from functools import partial

    from verl.workers.utils.losses import sft_loss

    return partial(sft_loss, config=None)


def test_score_mask_skips_rows_verl_never_reads(monkeypatch):
    from verl.workers.utils.padding import no_padding_2_padding

    monkeypatch.setenv(ENV_VAR, "1")
    engine, model = built({"output_processor_backend": "torch"})
    batch = rl_batch(0.7)
    with torch.no_grad():
        counter_masked = OutputWeightRows(model.config.hidden_size, VOCAB)
        with counter_masked:
            masked = forward_step(engine, model, batch)  # forward only: loss None, prompts/responses present
        counter_full = OutputWeightRows(model.config.hidden_size, VOCAB)
        with counter_full:
            full = forward_step(engine, model, batch, loss_function=partial_sft())  # SFT reads every row
    assert counter_full.rows == sum(PROMPT_LENS) + sum(RESPONSE_LENS)
    assert counter_masked.rows == sum(RESPONSE_LENS)  # prompt rows and each sequence's last row: no matmul
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(
            no_padding_2_padding(masked[key], batch), no_padding_2_padding(full[key], batch), **CLOSE
        )
        read = torch.zeros(masked[key].values().shape, dtype=torch.bool)
        offsets = batch["input_ids"].offsets()
        for start, p, r in zip(offsets[:-1].tolist(), PROMPT_LENS, RESPONSE_LENS):
            read[start + p - 1 : start + p + r - 1] = True
        assert bool((masked[key].values()[~read] == 0).all())


def test_ppo_loss_qualifies_for_score_mask():
    from functools import partial

    from verl.workers.utils.losses import ppo_loss

    from verl_fused_hook.verl_integration.forward_step import response_score_rows

    batch = rl_batch(1.0)
    rows = response_score_rows(batch, partial(ppo_loss, config=None))
    assert rows is not None and int(rows.values().sum()) == sum(RESPONSE_LENS)
    assert response_score_rows(batch, partial_sft()) is None


# ---------------------------------------------------------------- MTP


def test_verl_mtp_postprocess_patch_keeps_the_hook(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")
    engine, model = built({"output_processor_backend": "torch"})
    batch = rl_batch(0.7)
    before = engine_forward(engine, model, batch)
    mtp_patch.patch_postprocess(model)  # what verl does for forward-only engines with mtp_num_layers=0
    after = engine_forward(engine, model, batch)
    torch.testing.assert_close(after["log_probs"].values(), before["log_probs"].values(), **EXACT)

    unprotected = tiny_model()
    engine2 = megatron_engine([unprotected], fused_kernel_options={"output_processor_backend": "torch"})
    engine2._maybe_enable_fused_kernels()
    call_sites.original(mtp_patch, "patch_postprocess")(unprotected)  # verl's patch alone drops the hook:
    with pytest.raises(AttributeError, match="log_probs"):
        engine_forward(engine2, unprotected, batch)


# MTP engines (hook mode keeps fused kernels on; the switch unset keeps verl's disable): tests/test_mtp.py


# ---------------------------------------------------------------- mbridge, plugin loading


def test_mbridge_get_model_builds_on_megatron_core_019():
    import mbridge.core.util as mbridge_util
    from megatron.core.models.gpt.gpt_model import ModelType  # the enum mbridge imports

    from verl_fused_hook.verl_integration import mbridge_compat

    def provider(pre_process, post_process, vp_stage=None):
        return tiny_model()

    patched = mbridge_util.ModelType
    assert hasattr(patched, "encoder_and_decoder")  # install() fixed mbridge when it was imported
    kwargs = dict(wrap_with_ddp=False, bf16=False, use_torch_fsdp2=True, use_cpu_initialization=True)
    try:
        mbridge_util.ModelType = ModelType  # megatron-core 0.19's enum, as mbridge imports it
        assert not hasattr(ModelType, "encoder_and_decoder")
        with pytest.raises(AttributeError, match="encoder_and_decoder"):
            mbridge_util.get_model(provider, **kwargs)
        assert mbridge_compat.apply(mbridge_util) is True
        assert mbridge_compat.apply(mbridge_util) is False  # idempotent
        models = mbridge_util.get_model(provider, **kwargs)
    finally:
        mbridge_util.ModelType = patched
    assert len(models) == 1 and isinstance(models[0], GPTModel)
    assert models[0].model_type is ModelType.encoder_or_decoder


GATE_FILE = "verl_fused_hook/verl_integration/call_sites.py"
REPORT_GATE = (
    "import verl.workers.engine.megatron.transformer_impl as t\n"
    "print(t.MegatronEngine._maybe_enable_fused_kernels.__code__.co_filename)\n"
)


def fresh_python(code: str, **env):
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_import_verl_loads_the_plugin_through_its_entry_point():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["verl.plugins"]
    assert declared == {"verl_fused_hook": "verl_fused_hook.verl_integration.plugin"}
    # The package is installed (pip install -e .[test]), so verl's own loader finds the entry point.
    assert fresh_python("import verl\n" + REPORT_GATE, VERL_USE_EXTERNAL_PLUGINS="verl_fused_hook").endswith(GATE_FILE)


def test_external_lib_installs_the_plugin_in_a_fresh_process():
    code = (
        "import verl\nfrom verl.utils.import_utils import import_external_libs\n"
        "import_external_libs('verl_fused_hook')\n"
    )
    assert fresh_python(code + REPORT_GATE, VERL_USE_EXTERNAL_PLUGINS="none").endswith(GATE_FILE)


def test_when_imported_runs_after_the_import_and_for_loaded_modules(tmp_path, monkeypatch):
    from verl_fused_hook.verl_integration.lazy_import import when_imported

    (tmp_path / "late_module_for_test.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    when_imported("late_module_for_test", lambda module: seen.append(module.VALUE + 1))
    assert seen == []
    import late_module_for_test  # noqa: F401

    assert seen == [42]
    when_imported("late_module_for_test", lambda module: seen.append(module.VALUE))
    assert seen == [42, 41]
    monkeypatch.delitem(sys.modules, "late_module_for_test")


def test_bad_switch_value_is_logged_when_the_plugin_loads(monkeypatch, caplog):
    monkeypatch.setenv(ENV_VAR, "true")
    install()  # verl's plugin loader would swallow an exception here, so install logs instead
    assert "VERL_FUSED_USE_OP_HOOK='true' is not allowed" in caplog.text
    assert "the Megatron engine build will stop with this error" in caplog.text


def _tp2_hook_step_worker(rank, world_size):
    """TP=2 with sequence parallelism: forward_step with mixed temperatures and the score mask, vs uniform runs."""
    from verl.workers.utils.padding import no_padding_2_padding

    init_model_parallel(world_size)
    model = build_cpu_gpt(tiny_transformer_config(sequence_parallel=True), vocab_size=VOCAB, seed=7)
    engine = megatron_engine([model], fused_kernel_options={"output_processor_backend": "torch"})
    engine._maybe_enable_fused_kernels()
    batch = rl_batch([0.7, 1.0, 0.5])
    mixed = forward_step(engine, model, batch)  # forward only: score mask on
    uniform = {t: forward_step(engine, model, rl_batch([t] * 3), partial_sft()) for t in (0.7, 1.0, 0.5)}
    read = {key: no_padding_2_padding(mixed[key], batch).detach() for key in ("log_probs", "entropy")}
    expected = {
        key: torch.stack([no_padding_2_padding(uniform[t][key], batch)[i] for i, t in enumerate((0.7, 1.0, 0.5))])
        for key in ("log_probs", "entropy")
    }
    return {
        "read": read,
        "expected": {k: v.detach() for k, v in expected.items()},
        "total": {k: mixed[k].values().detach() for k in ("log_probs", "entropy")},
    }


def test_tp2_sequence_parallel_mixed_temperatures_and_score_mask():
    from verl_fused_hook_harness.support.distributed import run_in_processes

    results = run_in_processes(_tp2_hook_step_worker, 2, env={ENV_VAR: "1"})
    for result in results:
        for key in ("log_probs", "entropy"):
            torch.testing.assert_close(result["read"][key], result["expected"][key], **CLOSE)
            scored = int((result["total"][key] != 0).sum())
            assert scored == sum(RESPONSE_LENS)  # every unread row is exactly 0
    torch.testing.assert_close(results[0]["total"]["log_probs"], results[1]["total"]["log_probs"], **EXACT)
