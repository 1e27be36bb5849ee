"""The A/B script's padded (BSHD) layout: verl as it ships against hook mode, on `use_remove_padding=False` engines.

verl has no fused BSHD path: its build step turns fused kernels off for such
engines, so its side of the comparison is verl's unfused BSHD forward (full
logits, `preprocess_bshd_engine`, vocab-parallel log-softmax) with the switch
unset. Hook mode keeps fused kernels on and runs `bshd_forward`. Both sides go
through verl's real build step and `MegatronEngineWithLMHead.forward_step`
(forward only, so the hook scores only the rows the loss reads), then the same
GRPO-style loss and backward. Two kinds of arithmetic, so the comparison is
held to the script's unfused tolerance (relative to verl's largest magnitude),
on the rows the loss reads and every parameter gradient.
"""

from __future__ import annotations

import os

import torch

from verl_fused_hook.switch import ENV_VAR

REFERENCE = "verl"  # the switch unset: verl turns fused kernels off and runs its unfused BSHD forward
RESOLVED = {"legacy": "unfused", "hook": "hook"}  # keys: the A/B script's modes


def _batch(prompts, responses, temperature: float, device: str):
    from verl.utils import tensordict_utils as tu

    def nested(parts):
        return torch.nested.as_nested_tensor([p.to(device) for p in parts], layout=torch.jagged)

    loss_mask = [torch.cat([torch.zeros(len(p)), torch.ones(len(r))]).long() for p, r in zip(prompts, responses)]
    return tu.get_tensordict(
        {
            "input_ids": nested([torch.cat(pair) for pair in zip(prompts, responses)]),
            "loss_mask": nested(loss_mask),
            "prompts": nested(prompts),
            "responses": nested(responses),
            "temperature": torch.full((len(prompts),), temperature, dtype=torch.float32, device=device),
        },
        non_tensor_dict={"calculate_entropy": True},
    )


def read_rows(values: torch.Tensor, data) -> torch.Tensor:
    """The rows the loss reads (each response token's prediction), flattened."""
    from verl.workers.utils.padding import no_padding_2_padding

    padded = no_padding_2_padding(values, data)
    lengths = data["responses"].offsets().diff().to(padded.device)
    return padded[torch.arange(padded.shape[1], device=padded.device)[None] < lengths[:, None]]


def run_bshd_once(mode: str, setup, hf_config, model, tracker) -> dict:
    """One forward_step + loss + backward on a BSHD engine; mode "legacy" runs verl as it ships (switch unset)."""
    from .ab_parity import TEMPERATURE, grpo_loss, make_batch

    if mode != "hook":
        os.environ.pop(ENV_VAR, None)
    from verl_fused_hook_harness.support.verl_engine import megatron_engine

    options = {"output_processor_backend": setup.backend} if mode == "hook" else {}
    engine = megatron_engine([model], fused_kernel_options=options, model_path=setup.hf_path, use_remove_padding=False)
    engine._maybe_enable_fused_kernels()  # verl's build step, through the plugin's gate
    fused = engine.engine_config.use_fused_kernels
    prompts, responses, advantages, old_offset = make_batch(hf_config.vocab_size, setup.seed)
    data = _batch(prompts, responses, TEMPERATURE, setup.device)
    if setup.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with tracker:
        output, _ = engine.forward_step(iter([data]), model, None, lambda out, **_: out)
        loss = grpo_loss(output["log_probs"], output["entropy"], data, advantages, old_offset)
        loss.backward()
    peak = torch.cuda.max_memory_allocated() - base if setup.device == "cuda" else tracker.peak
    return {
        "mode": getattr(model, "_verl_fused_forward_mode", None) if fused else "unfused",
        "log_probs": read_rows(output["log_probs"], data).detach().cpu(),
        "entropy": read_rows(output["entropy"], data).detach().cpu(),
        "policy_loss": loss.detach().reshape(1).cpu(),
        "grads": {name: p.grad.detach().cpu() for name, p in model.named_parameters() if p.grad is not None},
        "peak_bytes": int(peak),
    }


def evaluate_bshd(scenario, runs: dict, rtol: float) -> dict:
    """Hook vs verl's unfused BSHD forward, relative to verl's largest magnitudes, within `rtol`."""
    from .ab_parity import _within, compare

    name = scenario.name
    entry = {"scenario": {"tp": scenario.tp, "sequence_parallel": scenario.sequence_parallel, "tied": scenario.tied,
                          "name": name, "layout": "bshd"}}
    entry["modes_resolved"] = {mode: runs[mode][0][name]["mode"] for mode in RESOLVED}
    entry["peak_bytes"] = {mode: max(r[name]["peak_bytes"] for r in runs[mode]) for mode in RESOLVED}
    entry["compared_against"] = f"{REFERENCE} (unfused BSHD)"
    entry["vs_unfused_rel"] = {"hook": compare(runs["legacy"], name, runs["hook"], name, relative=True)}
    entry["match"] = entry["modes_resolved"] == RESOLVED and _within(entry["vs_unfused_rel"]["hook"], rtol)
    return entry


def print_bshd_report(report: dict) -> None:
    from .ab_parity import _row

    print()
    print(f"{'scenario':<18} {'compared':<28} {'log_probs':>10} {'entropy':>10} {'loss':>10} {'grads':>10}  worst grad")
    for entry in report["scenarios"]:
        mismatch = "" if entry["match"] else "   MISMATCH"
        print(_row(entry["scenario"]["name"], "hook vs verl unfused (rel)", entry["vs_unfused_rel"]["hook"], mismatch))
    print()
    print(f"{'scenario':<18} {'peak verl':>14} {'peak hook':>14}   (bytes of tensors alive during forward+backward)")
    for entry in report["scenarios"]:
        peaks = entry["peak_bytes"]
        print(f"{entry['scenario']['name']:<18} {peaks['legacy']:>14,} {peaks['hook']:>14,}")
    print()
    if report["match"]:
        print(f"PASS: BSHD hook mode (fused kernels kept on) within {report['unfused_rtol']:g} of verl's unfused BSHD "
              "forward (verl as it ships turns fused kernels off there)")
    else:
        print("FAIL: mismatches above")
