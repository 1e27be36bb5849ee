"""`ab-parity` on packed (THD) batches: verl's legacy fused forward against the output_processor hook.

One forward+backward per scenario and variant through verl's real build step and its engine forward:
"fused" (the process's mode), "tp-sum" (legacy with the TP sum of the hidden gradient added) and "unfused"
(verl's full-logit forward, the ground truth). `evaluate` judges one scenario's runs, `print_report` prints
the table. The model, engine and batch are identical in every process.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import asdict

import torch

from ...stand_ins.legacy_kernel_swap import legacy_kernel_with_tp_sum, portable_legacy_kernel_on_cpu
from ...support.compare import VALUES
from ...support.determinism import deterministic_steps
from ...support.memory import PeakMemory
from ...support.micro_batches import TEMPERATURE, ab_rollout, engine_inputs, grpo_loss
from ...support.verl_engine import UNFUSED as UNFUSED_MODE
from ...support.verl_engine import fused_engine_forward, megatron_engine, resolved_mode
from .scenarios import (
    ENV_VALUES,
    RERUN,
    TABLE_HEADER,
    TP_GAP,
    TWO_KERNEL_GRAD_RTOL,
    TWO_KERNEL_VALUE_TOL,
    UNFUSED,
    UNFUSED_RTOL,
    Scenario,
    Setup,
    build_model,
    compare_runs,
    comparison_row,
    exact,
    gradients_of,
    peak_table,
    within,
)


def legacy_kernel(device: str, backend: str, tp_sum: bool):
    """The kernel verl's legacy forward calls: portable on the CPU, verl's Triton on CUDA; optionally TP-summed."""
    stack = contextlib.ExitStack()
    stack.enter_context(portable_legacy_kernel_on_cpu(device, backend))
    if tp_sum:
        stack.enter_context(legacy_kernel_with_tp_sum())
    return stack


def unfused_forward(engine, model, input_ids):
    """verl's unfused engine forward (full logits, vocab-parallel log-softmax): the ground truth."""
    import verl.models.mcore as mcore  # verl loads in the worker processes only
    from verl.utils.torch_functional import expand_as_nested

    processor = functools.partial(
        engine._lm_head_logits_processor,
        calculate_sum_pi_squared=False,
        calculate_entropy=True,
        distillation_use_topk=False,
        distillation_only=False,
        logits_processor_func=None,
        batch=None,
        data_format="thd",
    )
    temperature = expand_as_nested(torch.full((input_ids.shape[0],), TEMPERATURE, device=input_ids.device), input_ids)
    return mcore.get_mcore_engine_forward_fn(engine.model_config.hf_config)(
        model,
        input_ids,
        {},
        logits_processor=processor,
        logits_processor_args={"label": input_ids.clone(), "temperature": temperature},
        pad_token_id=engine.model_config.tokenizer.pad_token_id,
        data_format="thd",
    )


def run_once(scenario: Scenario, mode: str, setup: Setup, variant: str) -> dict:
    """One forward+backward of one scenario; variant "fused" (this process's mode), "tp-sum" or "unfused".
    On CUDA deterministic (see parity.py's docstring)."""
    device = setup.device
    hf_config, model = build_model(scenario, setup)
    options = {"output_processor_backend": setup.backend} if mode == "hook" else {}
    engine = megatron_engine([model], fused_kernel_options=options, model_path=setup.hf_path)
    prompts, responses, advantages, old_offset = ab_rollout(hf_config.vocab_size, setup.seed)
    input_ids, data = engine_inputs(prompts, responses, device)
    fused = variant != "unfused"
    if fused:
        engine._maybe_enable_fused_kernels()  # verl's build step, through the plugin's gate
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    tracker = contextlib.nullcontext() if device == "cuda" else PeakMemory()
    kernel = legacy_kernel(device, setup.backend, tp_sum=variant == "tp-sum") if fused else contextlib.nullcontext()
    repeatable = deterministic_steps(model, te_attention=True) if device == "cuda" else contextlib.nullcontext()
    with kernel, tracker, repeatable:
        if fused:
            output = fused_engine_forward(engine, model, input_ids, TEMPERATURE)
        else:
            output = unfused_forward(engine, model, input_ids)
        loss = grpo_loss(output["log_probs"], output["entropy"], data, advantages, old_offset)
        loss.backward()
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else tracker.peak
    return {
        "mode": resolved_mode(model, engine) if fused else UNFUSED_MODE,
        "log_probs": output["log_probs"].values().detach().cpu(),
        "entropy": output["entropy"].values().detach().cpu(),
        "policy_loss": loss.detach().reshape(1).cpu(),
        "grads": gradients_of(model),
        "peak_bytes": int(peak),
    }


def run_scenario(scenario: Scenario, mode: str, setup: Setup) -> dict:
    """This process's runs of one scenario, by result key. On CUDA legacy runs it twice (RERUN): the rerun
    must match exactly, which shows the deterministic set-up holds, so that a zero between modes means the
    modes agree; legacy also runs with the TP sum where the scenario has the TP gap; hook also runs verl's
    unfused forward (the ground truth)."""
    name = scenario.name
    results = {name: run_once(scenario, mode, setup, variant="fused")}
    if mode == "legacy" and setup.device == "cuda":
        results[f"{name}:{RERUN}"] = run_once(scenario, mode, setup, variant="fused")
    if mode == "legacy" and scenario.has_tp_gap:
        results[f"{name}:{TP_GAP}"] = run_once(scenario, mode, setup, variant="tp-sum")
    if mode == "hook":
        results[f"{name}:{UNFUSED}"] = run_once(scenario, mode, setup, variant="unfused")
    return results


def within_kernel_accuracy(absolute: dict, relative: dict) -> bool:
    """Two kernels: values within TWO_KERNEL_VALUE_TOL (absolute), gradients within TWO_KERNEL_GRAD_RTOL."""
    values = all(absolute[k] <= TWO_KERNEL_VALUE_TOL for k in VALUES)
    return values and relative["grads"] <= TWO_KERNEL_GRAD_RTOL


def evaluate(scenario: Scenario, runs: dict, one_kernel: bool = True, rtol: float = UNFUSED_RTOL) -> dict:
    """One scenario's report entry: legacy/hook parity (exact with one kernel, within the kernels' accuracy
    with two), the legacy rerun (exact, where run) and both modes against verl's unfused forward."""
    name = scenario.name
    entry = {"scenario": asdict(scenario) | {"name": name}}
    entry["modes_resolved"] = {mode: runs[mode][0][name]["mode"] for mode in ENV_VALUES}
    entry["peak_bytes"] = {mode: max(r[name]["peak_bytes"] for r in runs[mode]) for mode in ENV_VALUES}
    legacy_key = f"{name}:{TP_GAP}" if scenario.has_tp_gap else name
    entry["compared_against"] = TP_GAP if scenario.has_tp_gap else "legacy"
    entry["max_abs"] = compare_runs(runs["legacy"], legacy_key, runs["hook"], name)
    if not one_kernel:
        entry["rel"] = compare_runs(runs["legacy"], legacy_key, runs["hook"], name, relative=True)
    rerun = f"{name}:{RERUN}"
    if rerun in runs["legacy"][0]:
        entry["legacy_rerun"] = compare_runs(runs["legacy"], name, runs["legacy"], rerun)
    if scenario.has_tp_gap:
        entry["vs_legacy_expected_gap"] = compare_runs(runs["legacy"], name, runs["hook"], name)
    reference = f"{name}:{UNFUSED}"
    entry["vs_unfused_rel"] = {
        "hook": compare_runs(runs["hook"], reference, runs["hook"], name, relative=True),
        "legacy": compare_runs(runs["hook"], reference, runs["legacy"], name, relative=True),
    }
    parity = exact(entry["max_abs"]) if one_kernel else within_kernel_accuracy(entry["max_abs"], entry["rel"])
    entry["match"] = (
        entry["modes_resolved"] == {"legacy": "legacy", "hook": "hook"}
        and parity
        and ("legacy_rerun" not in entry or exact(entry["legacy_rerun"]))
        and within(entry["vs_unfused_rel"]["hook"], rtol)
    )
    return entry


def print_report(report: dict) -> None:
    print()
    print(TABLE_HEADER)
    for entry in report["scenarios"]:
        name = entry["scenario"]["name"]
        mismatch = "" if entry["match"] else "   MISMATCH"
        print(comparison_row(name, f"hook vs {entry['compared_against']} (abs)", entry["max_abs"], mismatch))
        if "rel" in entry:
            print(
                comparison_row(
                    "", f"hook vs {entry['compared_against']} (rel)", entry["rel"], "  two kernels: accuracy bounds"
                )
            )
        if "legacy_rerun" in entry:
            print(
                comparison_row(
                    "", "legacy vs legacy rerun (abs)", entry["legacy_rerun"], "  must be 0: repeatable runs"
                )
            )
        if "vs_legacy_expected_gap" in entry:
            print(
                comparison_row(
                    "", "hook vs legacy (abs)", entry["vs_legacy_expected_gap"], "  expected: the TP gradient sum"
                )
            )
        print(comparison_row("", f"hook vs {UNFUSED} (rel)", entry["vs_unfused_rel"]["hook"]))
        gap = entry["scenario"]["tp"] > 1 and not entry["scenario"]["sequence_parallel"]
        wrong = "  verl's legacy gradient is wrong here" if gap else ""
        print(comparison_row("", f"legacy vs {UNFUSED} (rel)", entry["vs_unfused_rel"]["legacy"], wrong))
    print()
    print("\n".join(peak_table(report, "legacy")))
    print()
    unfused = f"within {report['unfused_rtol']:g} of verl's unfused forward"
    if not report["match"]:
        print("FAIL: mismatches above")
    elif not report["one_kernel"]:
        print(
            f"PASS: hook (backend={report['backend']}) within the kernels' accuracy of legacy (values <= "
            f"{TWO_KERNEL_VALUE_TOL:g}, gradients <= {TWO_KERNEL_GRAD_RTOL:g} relative) and {unfused}"
        )
    elif report["device"] == "cuda":
        print(f"PASS: hook and legacy identical (max_abs = 0; the legacy rerun identical too) and {unfused}")
    else:
        print(f"PASS: hook and legacy identical (max_abs = 0) and {unfused}")
