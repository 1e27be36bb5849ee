"""`ab-parity --layout bshd`: verl as it ships against hook mode, on `use_remove_padding=False` engines.

verl has no fused BSHD path: its build step turns fused kernels off for such
engines, so its side of the comparison is verl's unfused BSHD forward (full
logits, `preprocess_bshd_engine`, vocab-parallel log-softmax) with the switch
unset. Hook mode keeps fused kernels on and runs `bshd_forward`. Both sides go
through verl's real build step and `MegatronEngineWithLMHead.forward_step`
(forward only, so the hook scores only the rows the loss reads), then the same
GRPO-style loss and backward. Two kinds of arithmetic, so the comparison is
held to the script's unfused tolerance (relative to verl's largest magnitude),
on the rows the loss reads and every parameter gradient. Held to a tolerance,
these runs need no deterministic set-up.
"""

from __future__ import annotations

import contextlib

import torch

from ...support.memory import PeakMemory
from ...support.micro_batches import TEMPERATURE, ab_rollout, forward_step_batch, grpo_loss, jagged, response_values
from ...support.verl_engine import UNFUSED, build_step, megatron_engine
from .scenarios import (
    ENV_VALUES,
    TABLE_HEADER,
    Scenario,
    Setup,
    build_model,
    compare_runs,
    comparison_row,
    gradients_of,
    peak_table,
    within,
)

REFERENCE = "verl"  # the switch unset: verl turns fused kernels off and runs its unfused BSHD forward
RESOLVED = {"legacy": UNFUSED, "hook": "hook"}  # keys: the A/B script's modes


def run_bshd(scenario: Scenario, mode: str, setup: Setup) -> dict:
    """One forward_step + loss + backward on a BSHD engine; mode "legacy" runs verl as it ships (switch unset)."""
    device = setup.device
    hf_config, model = build_model(scenario, setup)
    options = {"output_processor_backend": setup.backend} if mode == "hook" else {}
    engine = megatron_engine([model], fused_kernel_options=options, model_path=setup.hf_path, use_remove_padding=False)
    resolved = build_step(model, engine, ENV_VALUES["hook"] if mode == "hook" else None)
    prompts, responses, advantages, old_offset = ab_rollout(hf_config.vocab_size, setup.seed)
    input_ids = jagged([torch.cat(pair) for pair in zip(prompts, responses)], device)
    data = forward_step_batch(input_ids, jagged(prompts, device), jagged(responses, device), TEMPERATURE)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    tracker = contextlib.nullcontext() if device == "cuda" else PeakMemory()
    with tracker:
        output, _ = engine.forward_step(iter([data]), model, None, lambda out, **_: out)
        loss = grpo_loss(output["log_probs"], output["entropy"], data, advantages, old_offset)
        loss.backward()
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else tracker.peak
    return {
        "mode": resolved,
        "log_probs": response_values(output["log_probs"], data).detach().cpu(),
        "entropy": response_values(output["entropy"], data).detach().cpu(),
        "policy_loss": loss.detach().reshape(1).cpu(),
        "grads": gradients_of(model),
        "peak_bytes": int(peak),
    }


def evaluate_bshd(scenario: Scenario, runs: dict, rtol: float) -> dict:
    """Hook vs verl's unfused BSHD forward, relative to verl's largest magnitudes, within `rtol`."""
    name = scenario.name
    entry = {
        "scenario": {
            "tp": scenario.tp,
            "sequence_parallel": scenario.sequence_parallel,
            "tied": scenario.tied,
            "name": name,
            "layout": "bshd",
        }
    }
    entry["modes_resolved"] = {mode: runs[mode][0][name]["mode"] for mode in RESOLVED}
    entry["peak_bytes"] = {mode: max(r[name]["peak_bytes"] for r in runs[mode]) for mode in RESOLVED}
    entry["compared_against"] = f"{REFERENCE} (unfused BSHD)"
    entry["vs_unfused_rel"] = {"hook": compare_runs(runs["legacy"], name, runs["hook"], name, relative=True)}
    entry["match"] = entry["modes_resolved"] == RESOLVED and within(entry["vs_unfused_rel"]["hook"], rtol)
    return entry


def print_bshd_report(report: dict) -> None:
    print()
    print(TABLE_HEADER)
    for entry in report["scenarios"]:
        mismatch = "" if entry["match"] else "   MISMATCH"
        print(
            comparison_row(
                entry["scenario"]["name"], "hook vs verl unfused (rel)", entry["vs_unfused_rel"]["hook"], mismatch
            )
        )
    print()
    print("\n".join(peak_table(report, REFERENCE)))
    print()
    if report["match"]:
        print(
            f"PASS: BSHD hook mode (fused kernels kept on) within {report['unfused_rtol']:g} of verl's unfused BSHD "
            "forward (verl as it ships turns fused kernels off there)"
        )
    else:
        print("FAIL: mismatches above")
