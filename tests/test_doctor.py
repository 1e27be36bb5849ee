"""`verl-fused-hook doctor` on the CPU: every check's line, and a non-zero exit for what would fail at start-up."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
OLD_MEGATRON = Path(__file__).resolve().parent / "old_megatron"  # test-only fake: GPTModel.forward without the hook


def doctor(*args: str, env: dict | None = None, pythonpath: tuple[Path, ...] = ()) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "VERL_FUSED_USE_OP_HOOK"}
    environ["PYTHONPATH"] = os.pathsep.join(map(str, (*pythonpath, ROOT)))
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "verl_fused_hook_harness.cli", "doctor", *args],
        capture_output=True,
        text=True,
        env=environ,
        cwd=ROOT,
        timeout=600,
    )


def lines(done: subprocess.CompletedProcess) -> dict[str, str]:
    """topic -> "status text", of the check lines."""
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith("[") and line[5:7] == "] ":  # "[stat] topic (padded to 14) text"
            found[line[7:21].strip()] = f"{line[1:5].strip()} {line[22:]}"
    return found


def test_doctor_passes_on_a_supported_cpu_machine():
    done = doctor("--hidden-size", "3584", env={"VERL_FUSED_USE_OP_HOOK": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    checks = lines(done)
    assert checks["megatron-core"].startswith("ok 0.19.2 (>= 0.19)")
    assert checks["verl"].startswith("ok 0.9.1")
    assert checks["hook probe"].startswith("ok") and "log-probs match its logits" in checks["hook probe"]
    assert (
        "auto picks torch for bfloat16 H=3584 on cpu; triton: CUDA is not available; torch: runs; verl: "
        in checks["backends"]
    )
    assert "verl_fused_hook = verl_fused_hook.verl_integration.plugin imports" in checks["entry point"]
    assert "uses the output_processor hook, backend=auto (VERL_FUSED_USE_OP_HOOK=1)" in checks["plan"]
    assert checks["op self-check"].startswith("ok cpu float32 300x256x5003")
    assert checks["invariance"] == (
        "ok cpu float32, backend torch, the ops' defaults: 77 rows alone and among 5 and 1000 others (first, "
        "last, others masked): the same bits (actor_rollout_ref.model.fused_kernel_options."
        "output_processor_batch_invariant=true is not needed for them)"
    )
    # no Transformer Engine here: verl's engine could not build a model (a warning), the harness builds local
    assert checks["TE"] == (
        "warn Transformer Engine does not import (ModuleNotFoundError: No module named 'transformer_engine'): "
        "verl's Megatron engine builds its models with TE's layer spec (Megatron-Bridge by default, mbridge with "
        "vanilla_mbridge=True: both build TE's spec only), so an engine build fails here"
    )
    assert checks["layer spec"].startswith(
        "ok verl's engine: te (its model bridges build TE's spec only), which cannot build here; the harness's "
        "commands: local (auto: no CUDA device (Transformer Engine's layers run on GPUs only); transformer_engine "
        "does not import"
    )
    # verl's default builder is not installed here (it imports Transformer Engine): a warning with both ways out
    assert checks["bridge"] == (
        "warn Megatron-Bridge does not import (ModuleNotFoundError: No module named 'megatron.bridge'): verl's "
        "default builder (vanilla_mbridge=False) fails here; install megatron-bridge with what it imports "
        "(Transformer Engine, megatron-energon), or build through mbridge with "
        "actor_rollout_ref.actor.megatron.vanilla_mbridge=True"
    )
    assert checks["verl defaults"] == "ok no TE build here (the TE line says why): nothing more to check"
    assert checks["replay"] == (
        "ok off (actor_rollout_ref.model.fused_kernel_options.output_processor_sampling_replay not true in hook mode)"
    )
    assert done.stdout.rstrip().endswith("doctor: OK (17 checks, 2 warnings)")
    assert len(done.stdout.splitlines()) == 18  # the checks and the verdict: upstream notices are summarised
    assert "upstream notices:" in done.stderr and "--verbose shows them" in done.stderr


def test_doctor_fails_when_megatron_core_lacks_the_hook():
    done = doctor(pythonpath=(OLD_MEGATRON,))
    assert done.returncode == 1, done.stdout + done.stderr
    probe = lines(done)["hook probe"]
    assert probe.startswith("FAIL GPTModel.forward has no output_processor / output_processor_context parameter")
    assert "needs megatron-core>=0.18.0" in probe
    assert "doctor: FAIL: hook probe" in done.stdout


def test_releases_below_the_declared_bounds_fail_naming_what_needs_the_newer_one():
    """pyproject.toml's bounds, said by the versions line: torch 2.7 and megatron-core 0.18 are too old."""
    from verl_fused_hook_harness.commands.doctor import check_versions

    installed = {"torch": "2.7.1", "megatron-core": "0.18.1", "verl": "0.9.1", "mbridge": "0.15.1"}
    findings = {finding.topic: finding for finding in check_versions(installed.get)}
    assert findings["torch"].status == "FAIL"
    assert findings["torch"].text == (
        "2.7.1 is too old (>= 2.8 needed for verl 0.9.1's engine and distillation, and gloo's port 0 on the CPU)"
    )
    assert findings["megatron-core"].text == (
        "0.18.1 is too old (>= 0.19 needed for the output_processor hook (0.18, PR 4686) and the MTP loss's config "
        "and logging (0.19))"
    )
    assert findings["verl"].status == "ok" and findings["mbridge"].status == "ok"


def test_the_declared_bounds_are_the_ones_doctor_the_probe_and_versions_sh_use():
    """pyproject.toml's lower bounds, doctor's version lines, the probe's message and scripts/versions.sh's lower column
    say one thing: a bound raised in one place and not the others fails here."""
    from verl_fused_hook.probe import SUPPORTED_MEGATRON
    from verl_fused_hook_harness.commands.doctor import REQUIRED

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = dict(requirement.split(">=") for requirement in dependencies)
    assert declared == {"torch": "2.8", "megatron-core": "0.19"}
    oldest = {distribution: version for distribution, version, _ in REQUIRED}
    assert {name: oldest[name] for name in declared} == declared
    assert Version(SUPPORTED_MEGATRON) == Version(declared["megatron-core"])
    lower_pins = (ROOT / "scripts" / "versions.sh").read_text().split("LOWER_PINS=(")[1].split(")")[0]
    assert f'"torch=={declared["torch"]}.*"' in lower_pins
    assert f'"megatron-core=={SUPPORTED_MEGATRON}"' in lower_pins


def test_entry_point_missing_says_where_the_package_imports_from_and_what_to_do():
    """A source tree on PYTHONPATH (as the GPU runs use it) imports but has no entry point: a failure for verl's
    loader, said as such, with both ways out."""
    from verl_fused_hook_harness.commands.doctor import check_entry_point

    finding = check_entry_point(entries=[])
    assert finding.status == "FAIL"
    assert finding.text == (
        f"no verl.plugins entry 'verl_fused_hook': verl_fused_hook imports from {ROOT} but is not installed there (a "
        "source tree on PYTHONPATH has no entry points); `import verl` will not load the plugin: pip install the "
        "package into verl's environment, or set actor_rollout_ref.model.external_lib=verl_fused_hook"
    )


def test_doctor_fails_on_a_bad_switch_and_on_a_misspelt_entry():
    done = doctor(env={"VERL_FUSED_USE_OP_HOOK": "yes"})
    assert done.returncode == 1
    assert lines(done)["plan"].startswith("FAIL ValueError: VERL_FUSED_USE_OP_HOOK='yes' is not allowed; use 1")
    done = doctor(
        "+actor_rollout_ref.model.fused_kernel_options.output_processor_fused_los=true",
        env={"VERL_FUSED_USE_OP_HOOK": "1"},
    )
    assert done.returncode == 1
    plan = lines(done)["plan"]
    assert "output_processor_fused_los is not a verl_fused_hook entry; did you mean " in plan
    assert plan.endswith(
        "output_processor_fused_loss_chunk_gib, output_processor_score_mask, output_processor_keep_logits_gib, "
        "output_processor_batch_invariant, output_processor_sampling_replay, "
        "output_processor_sampling_replay_max_kept, output_processor_sampling_replay_reference"
    )


def test_doctor_resolves_the_plan_from_hydra_overrides():
    done = doctor(
        "+actor_rollout_ref.model.fused_kernel_options.use_output_processor_hook=true",
        "+actor_rollout_ref.model.fused_kernel_options.output_processor_fused_loss=true",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    plan = lines(done)["plan"]
    assert "the environment and actor_rollout_ref.model.fused_kernel_options of the composed config" in plan
    assert (
        "backend=auto (actor_rollout_ref.model.fused_kernel_options.use_output_processor_hook=true), "
        "output_processor_fused_loss=true" in plan
    )


def test_the_layer_spec_lines_follow_the_facts():
    """The lines for a machine with Transformer Engine and CUDA, with TE but no CUDA, and with CUDA but no TE."""
    from verl_fused_hook_harness.commands.doctor import layer_spec_findings
    from verl_fused_hook_harness.support.layer_spec import Presence

    te, no_te = Presence(True, "2.20.2"), Presence(False, "ImportError: libcudnn.so.9: cannot open shared object file")
    found = {(f.topic, f.status): f.text for f in layer_spec_findings(te, cuda=True)}
    assert found[("TE", "ok")].startswith(
        "Transformer Engine 2.20.2 imports (verl's Megatron engine builds its models with TE's layer spec"
    )
    assert found[("layer spec", "ok")] == (
        "verl's engine: te (its model bridges build TE's spec only); the harness's commands: te (auto: "
        "Transformer Engine 2.20.2 imports and CUDA is here)"
    )
    found = {(f.topic, f.status): f.text for f in layer_spec_findings(te, cuda=False)}
    assert found[("layer spec", "ok")].startswith(
        "verl's engine: te (its model bridges build TE's spec only), which cannot build here; the harness's commands: "
        "local (auto: no CUDA device"
    )
    found = {(f.topic, f.status): f.text for f in layer_spec_findings(no_te, cuda=True)}
    assert found[("TE", "warn")].startswith("Transformer Engine does not import (ImportError: libcudnn.so.9")
    assert found[("layer spec", "ok")].endswith(
        "the harness's commands: local (auto: transformer_engine does not import (ImportError: libcudnn.so.9: cannot "
        "open shared object file))"
    )


def test_the_verl_defaults_line_names_each_gap_and_its_way_out():
    """A TE build with verl's defaults: a FlashAttention for attention_backend=flash (either builder), apex's
    extension where Megatron-Bridge turns on gradient_accumulation_fusion; nothing to check without TE."""
    from verl_fused_hook_harness.commands.doctor import verl_defaults_finding
    from verl_fused_hook_harness.support.layer_spec import Presence

    te, no_te = Presence(True, "2.20.2"), Presence(False, "ModuleNotFoundError: No module named 'transformer_engine'")
    bridge, no_bridge = Presence(True, "0.6.2"), Presence(False, "ModuleNotFoundError: megatron.bridge")
    apex = Presence(True, "fused_weight_gradient_mlp_cuda")
    no_apex = Presence(False, "ModuleNotFoundError: No module named 'fused_weight_gradient_mlp_cuda'")
    flash = Presence(True, "FlashAttention-3 (flash_attn_3.flash_attn_interface)")
    no_flash = Presence(False, "ModuleNotFoundError: No module named 'flash_attn'")

    line = verl_defaults_finding(te, bridge, apex, flash)
    assert line.status == "ok" and line.text == (
        "attention_backend=flash runs FlashAttention-3 (flash_attn_3.flash_attn_interface), apex "
        "fused_weight_gradient_mlp_cuda (Megatron-Bridge's gradient_accumulation_fusion)"
    )
    line = verl_defaults_finding(te, bridge, no_apex, no_flash)
    assert line.status == "warn"
    assert "No dot product attention backend is available" in line.text
    assert "override_transformer_config.attention_backend=fused" in line.text
    assert "+actor_rollout_ref.actor.megatron.override_transformer_config.gradient_accumulation_fusion=False" in (
        line.text
    )
    # through mbridge alone no fusion is turned on: only the attention gap remains
    line = verl_defaults_finding(te, no_bridge, no_apex, no_flash)
    assert line.status == "warn" and "gradient_accumulation_fusion" not in line.text
    assert verl_defaults_finding(te, no_bridge, no_apex, flash).status == "ok"
    assert verl_defaults_finding(no_te, bridge, no_apex, no_flash).status == "ok"


def _visible_devices() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_the_probe_process_sees_no_gpu_and_this_one_keeps_its_environment(monkeypatch):
    """The hook probe's CPU model must not meet a GPU (megatron-core moves RoPE's frequencies to CUDA when it is
    there: the probe failed so on the H200); the doctor's own environment is left as it was."""
    import concurrent.futures
    import multiprocessing

    from verl_fused_hook_harness.commands.doctor import _environment_of_new_processes

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        with _environment_of_new_processes(CUDA_VISIBLE_DEVICES=""):
            seen = pool.submit(_visible_devices)
        assert seen.result(timeout=120) == ""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
