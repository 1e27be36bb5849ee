"""Which layer spec a build uses and when the TE-only options are refused (support/layer_spec.py): the decisions
given the machine's facts as arguments, this machine's own facts (no Transformer Engine here), and each command's
refusal at start-up, naming the option, what is missing and what to do instead."""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook_harness.support.layer_spec import (
    LAYER_SPECS,
    FlashAttention,
    OptionRefused,
    Presence,
    batch_invariant_refusal,
    bridge_refusal,
    choose_layer_spec,
    grad_accum_fusion_refusal,
    megatron_bridge,
    padded_fp32_refusal,
    spec_overrides,
    transformer_engine,
)

TE_HERE = Presence(True, "2.20.2")
NO_TE = Presence(False, "ModuleNotFoundError: No module named 'transformer_engine'")
FA3 = FlashAttention(3, "FlashAttention-3 (flash_attn_3.flash_attn_interface)")
NO_FLASH = FlashAttention(None, "flash_attn.cute: ModuleNotFoundError: No module named 'flash_attn'")


def test_auto_takes_te_only_where_it_builds():
    assert choose_layer_spec("auto", cuda=True, te=TE_HERE).spec == "te"
    assert (
        "Transformer Engine 2.20.2 imports and CUDA is here" in choose_layer_spec("auto", cuda=True, te=TE_HERE).reason
    )
    without_te = choose_layer_spec("auto", cuda=True, te=NO_TE)
    assert without_te.spec == "local" and "No module named 'transformer_engine'" in without_te.reason
    on_the_cpu = choose_layer_spec("auto", cuda=False, te=TE_HERE)
    assert on_the_cpu.spec == "local" and "no CUDA device" in on_the_cpu.reason


def test_local_is_always_local_and_te_is_refused_where_it_cannot_build():
    for cuda in (True, False):
        for te in (TE_HERE, NO_TE):
            assert choose_layer_spec("local", cuda=cuda, te=te).spec == "local"
    assert choose_layer_spec("te", cuda=True, te=TE_HERE).spec == "te"
    for cuda, te, missing in (
        (True, NO_TE, "transformer_engine does not import (ModuleNotFoundError"),
        (False, TE_HERE, "no CUDA device"),
    ):
        with pytest.raises(OptionRefused) as refused:
            choose_layer_spec("te", cuda=cuda, te=te)
        message = str(refused.value)
        assert message.startswith("--layer-spec te: Transformer Engine's layer spec cannot be built here: ")
        assert missing in message and "allowed: auto, local, te" in message
    with pytest.raises(OptionRefused, match="--layer-spec 'transformer': allowed auto, local, te"):
        choose_layer_spec("transformer", cuda=True, te=TE_HERE)
    assert LAYER_SPECS == ("auto", "local", "te")


def test_batch_invariant_needs_te_and_flash_attention_3_or_4():
    assert batch_invariant_refusal(spec="te", te=TE_HERE, flash=FA3) is None
    message = batch_invariant_refusal(spec="te", te=TE_HERE, flash=NO_FLASH)
    assert message.startswith("--batch-invariant: megatron-core's batch_invariant_mode needs Transformer Engine's")
    assert "FlashAttention 3 or 4 does not import (flash_attn.cute: ModuleNotFoundError" in message
    # the measured reason and the nearest working alternative
    assert "AssertionError: Batch invariant mode only supports FlashAttention (--attention-backend flash)" in message
    assert "tests/test_exact_on_policy.py" in message
    on_local = batch_invariant_refusal(spec="local", te=NO_TE, flash=NO_FLASH)
    assert "the build uses the local spec, not Transformer Engine's (--layer-spec te)" in on_local
    assert "transformer_engine does not import" in on_local


def test_grad_accum_fusion_needs_te_and_apex_for_the_output_layer():
    apex = Presence(True, "fused_weight_gradient_mlp_cuda")
    no_apex = Presence(False, "ModuleNotFoundError: No module named 'fused_weight_gradient_mlp_cuda'")
    assert grad_accum_fusion_refusal(spec="te", apex=apex) is None
    message = grad_accum_fusion_refusal(spec="te", apex=no_apex)
    assert message.startswith("--grad-accum-fusion: megatron's gradient_accumulation_fusion cannot run here: ")
    assert "ColumnParallelLinear (the output layer, on either spec)" in message
    assert "not Transformer Engine's" in grad_accum_fusion_refusal(spec="local", apex=apex)
    assert spec_overrides(grad_accum_fusion=True) == {"gradient_accumulation_fusion": True}
    assert spec_overrides() == {}


def test_megatron_bridge_builds_te_spec_only_and_needs_its_package():
    """verl 0.9.1's default builder: refused, naming what is missing and the other builder, where it cannot build;
    mbridge (vanilla_mbridge=True) builds on either spec."""
    bridge_here = Presence(True, "0.6.2")
    no_bridge = Presence(False, "ModuleNotFoundError: No module named 'transformer_engine'")
    assert bridge_refusal(bridge="megatron-bridge", spec="te", presence=bridge_here) is None
    for spec in ("te", "local"):
        assert bridge_refusal(bridge="mbridge", spec=spec, presence=no_bridge) is None
    assert bridge_refusal(bridge="megatron-bridge", spec="local", presence=no_bridge) == (
        "--bridge megatron-bridge: verl's default model builder cannot run here: the build uses the local spec; "
        "Megatron-Bridge builds Transformer Engine's only (--layer-spec te); Megatron-Bridge does not import "
        "(ModuleNotFoundError: No module named 'transformer_engine'); it needs Transformer Engine and "
        "megatron-energon. --bridge mbridge builds through mbridge (verl's vanilla_mbridge=True)"
    )
    assert bridge_refusal(bridge="nemo", spec="te", presence=bridge_here) == (
        "--bridge 'nemo': allowed: mbridge, megatron-bridge"
    )
    # here: not installed, or (installed) stopped by its import of Transformer Engine
    assert not megatron_bridge().importable


def test_te_is_refused_the_padded_layout_in_fp32_naming_whose_limitation_it_is():
    """Transformer Engine's fp32 attention (its unfused backend) cannot take verl's padded mask (the H100, issue 56):
    refused at start-up; bf16 on TE, and the local spec in fp32, run."""
    message = padded_fp32_refusal(spec="te", layout="bshd", fp32=True)
    assert message == (
        "--layout bshd in fp32 on Transformer Engine's layer spec: TE runs fp32 attention in its unfused backend only, "
        "and that backend's get_full_mask cannot take the padded attention mask verl passes (on the H100: 'The size "
        "of tensor a (14) must match the size of tensor b (4) at non-singleton dimension 2', in the decoder before "
        "the output layer, so verl's path and hook mode alike): Transformer Engine's limitation; use --dtype bf16 "
        "or --layer-spec local"
    )
    assert padded_fp32_refusal(spec="te", layout="bshd", fp32=False) is None
    assert padded_fp32_refusal(spec="te", layout="thd", fp32=True) is None
    assert padded_fp32_refusal(spec="local", layout="bshd", fp32=True) is None


def test_presence_names_the_first_module_that_does_not_import():
    """Megatron-Bridge's package imported on the H200 while verl's build stopped at its training config (its import
    of megatron-energon): every module verl imports is checked, and the one that fails is named."""
    from verl_fused_hook_harness.support.layer_spec import versioned_presence

    assert versioned_presence(("torch", "torch.nn"), "torch") == Presence(True, torch.__version__)
    assert versioned_presence(("verl_fused_hook_no_such_package",), "torch") == Presence(
        False, "ModuleNotFoundError: No module named 'verl_fused_hook_no_such_package'"
    )
    assert versioned_presence(("torch", "torch.no_such_module"), "torch") == Presence(
        False,
        "torch imports, torch.no_such_module does not: ModuleNotFoundError: No module named 'torch.no_such_module'",
    )


def test_train_parity_refuses_megatron_bridge_here_and_records_the_builder(capsys):
    import dataclasses

    from verl_fused_hook_harness.commands.train.parity import main, parse_plan
    from verl_fused_hook_harness.support.train_engine import EngineSetup, build_engine

    err = _refusal(capsys, main, ["--device", "cpu", "--bridge", "megatron-bridge"])
    assert "--bridge megatron-bridge: verl's default model builder cannot run here: the build uses the local" in err
    with pytest.raises(ValueError, match="^EngineSetup.bridge='megatron-bridge' builds Transformer Engine's spec"):
        build_engine(
            EngineSetup(hf_path="x", tp=1, dtype="float32", seed=1, micro_batch_size=1, total_steps=2, lr=1e-3,
                        offload=False, fused_kernel_options={}, bridge="megatron-bridge")
        )  # fmt: skip
    with pytest.raises(ValueError, match="^EngineSetup.bridge: 'nemo'; allowed: mbridge, megatron-bridge$"):
        build_engine(
            EngineSetup(hf_path="x", tp=1, dtype="float32", seed=1, micro_batch_size=1, total_steps=2, lr=1e-3,
                        offload=False, fused_kernel_options={}, bridge="nemo")
        )  # fmt: skip
    plan, _ = parse_plan(["--device", "cpu"], "/tmp/unused")
    assert plan.bridge == "mbridge" and "bridge" not in plan.configuration()  # as reports before the option
    assert dataclasses.replace(plan, bridge="megatron-bridge").configuration()["bridge"] == "megatron-bridge"


def test_this_machine_has_no_transformer_engine():
    """The CPU machines the tests run on: TE does not import, and the reason says why."""
    te = transformer_engine()
    assert not te.importable and "transformer_engine" in te.detail


def _refusal(capsys, main, argv) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", ["ab-parity", "e2e-bench", "train-parity"])
def test_each_command_refuses_te_and_batch_invariance_at_start_up(capsys, command):
    import importlib

    from verl_fused_hook_harness.cli import COMMANDS

    main = importlib.import_module(COMMANDS[command][0]).main
    err = _refusal(capsys, main, ["--device", "cpu", "--layer-spec", "te"])
    assert "--layer-spec te: Transformer Engine's layer spec cannot be built here: no CUDA device" in err
    assert "transformer_engine does not import (ModuleNotFoundError" in err and "allowed: auto, local, te" in err
    err = _refusal(capsys, main, ["--device", "cpu", "--batch-invariant"])
    assert "--batch-invariant: megatron-core's batch_invariant_mode needs Transformer Engine's layer spec" in err
    assert "the build uses the local spec" in err and "tests/test_exact_on_policy.py" in err


def test_e2e_bench_refuses_what_its_specs_cannot_take(capsys):
    from verl_fused_hook_harness.commands.e2e.bench import main

    err = _refusal(capsys, main, ["--device", "cpu", "--grad-accum-fusion"])
    assert (
        "--grad-accum-fusion: megatron's gradient_accumulation_fusion cannot run here: the build uses the local" in err
    )
    assert "apex's fused_weight_gradient_mlp_cuda does not import" in err
    err = _refusal(capsys, main, ["--device", "cpu", "--layer-specs", "local,te"])
    assert "--layer-spec te: Transformer Engine's layer spec cannot be built here" in err
    err = _refusal(capsys, main, ["--device", "cpu", "--layer-specs", "local,local"])
    assert "--layer-specs: each of local, te at most once, at least one, got ['local', 'local']" in err
    err = _refusal(capsys, main, ["--device", "cpu", "--layer-specs", "local,auto"])
    assert "--layer-specs: unknown ['auto']; allowed: local, te" in err
    err = _refusal(capsys, main, ["--device", "cpu", "--layer-spec", "local", "--layer-specs", "local"])
    assert "--layer-specs: give it or --layer-spec, not both" in err
    err = _refusal(capsys, main, ["--device", "cpu", "--output-layer-share", "--layout", "bshd"])
    assert "--output-layer-share: the packed layout's modes only" in err


def test_ab_parity_keeps_the_parallel_comparison_on_the_local_spec(capsys):
    from verl_fused_hook_harness.commands.ab.parity import main

    err = _refusal(capsys, main, ["--device", "cpu", "--pp", "2", "--layer-spec", "te"])
    assert "the --pp/--vpp/--ep/--moe-experts comparison draws each layer's weights by its global index" in err
