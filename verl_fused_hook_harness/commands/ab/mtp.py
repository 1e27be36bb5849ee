"""`ab-parity --mtp-layers N`: hook mode's fused MTP loss against verl's own MTP path.

With `actor_rollout_ref.model.mtp.enable=True, enable_train=True`, verl as it
ships turns fused kernels off: its unfused forward builds the main head's
logits and megatron's `process_mtp_loss` builds every MTP head's logits. Hook
mode keeps fused kernels on and computes both through the op. Each side runs
on identical weights and batch, through verl's build step, `patch_engine_mtp`
and `forward_step` (support/mtp_engine.py; the build step sees the switch as
each side sets it, so at one rank both sides share one process and pay the
start-up, imports and CUDA/NCCL initialization once), then the
same GRPO-style loss and its backward. Compared, relative to verl's side:
log-probs and entropy on the response rows, the loss, every parameter gradient
(MTP layers included, through the injected MTP loss) and the logged MTP loss;
acceptance counts must be equal on the CPU (fp32); on CUDA verl's argmax reads
bf16-rounded logits (ties at bf16 resolution go to the lowest id) and ours fp32
ones, so counts may differ by up to 2 or 1% of the total, whichever is larger.
"""

from __future__ import annotations

import time

import torch

from ...support.compare import error
from ...support.distributed import backend_for, run_in_processes
from ...support.micro_batches import TEMPERATURE, ab_rollout, forward_step_batch, grpo_loss, jagged, response_values
from ...support.mtp_engine import build_mtp_engine, mtp_forward, take_mtp_metrics
from ...support.reports import write_json
from ...support.verl_engine import prepare_verl_process
from .scenarios import TABLE_HEADER, build_model, compare_runs, comparison_row, gradients_of, within, world_size_for

SIDES = ("verl", "hook")
CUDA_ACCEPTANCE_SLACK = 0.01
CUDA_ACCEPTANCE_MIN_SLACK = 2


def run_side(scenario, side: str, setup, mtp_layers: int) -> dict:
    device = setup.device
    hf_config, model = build_model(scenario, setup, mtp_num_layers=mtp_layers)
    engine = build_mtp_engine(model, hook=side == "hook", backend=setup.backend, model_path=setup.hf_path)
    prompts, responses, advantages, old_offset = ab_rollout(hf_config.vocab_size, setup.seed)
    input_ids = jagged([torch.cat(pair) for pair in zip(prompts, responses)], device)
    batch = forward_step_batch(input_ids, jagged(prompts, device), jagged(responses, device), TEMPERATURE)
    take_mtp_metrics()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    output = mtp_forward(engine, model, batch)
    loss = grpo_loss(output["log_probs"], output["entropy"], batch, advantages, old_offset)
    loss.backward()
    return {
        "fused": engine.engine_config.use_fused_kernels,
        "log_probs": response_values(output["log_probs"], batch).detach().cpu(),
        "entropy": response_values(output["entropy"], batch).detach().cpu(),
        "policy_loss": loss.detach().reshape(1).cpu(),
        "grads": gradients_of(model),
        "mtp": take_mtp_metrics(),
        "peak_bytes": int(torch.cuda.max_memory_allocated() - base) if device == "cuda" else 0,
    }


def both_sides_worker(rank: int, world_size: int, scenarios, setup, mtp_layers: int):
    """verl's side, then hook mode's, in this one process: {side: side_worker's results}."""
    return {side: side_worker(rank, world_size, side, scenarios, setup, mtp_layers) for side in SIDES}


def side_worker(rank: int, world_size: int, side: str, scenarios, setup, mtp_layers: int):
    started = time.time()
    prepare_verl_process(rank)
    progress = rank == 0 and setup.verbose
    if progress:
        print(f"[{side}] verl's engine imported in {time.time() - started:.1f}s", flush=True)
    if setup.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    results = {}
    for scenario in scenarios:
        started = time.time()
        results[scenario.name] = run_side(scenario, side, setup, mtp_layers)
        if progress:
            print(f"[{side}, mtp_layers={mtp_layers}] {scenario.name} done in {time.time() - started:.1f}s", flush=True)
    return results


def metric_rows(verl_runs, hook_runs, name: str, device: str) -> tuple[dict, bool]:
    """Largest relative MTP-loss error and acceptance-count difference over ranks; whether they pass."""
    loss_error, count_gap, ok = 0.0, 0.0, True
    for verl_rank, hook_rank in zip(verl_runs, hook_runs):
        want, got = verl_rank[name]["mtp"], hook_rank[name]["mtp"]
        if set(want) != set(got) or not want:
            return {"mtp_loss": float("inf"), "acceptance_gap": float("inf")}, False
        loss_error = max(loss_error, error(want["loss_values"], got["loss_values"], relative=True))
        gap = (got["correct_values"] - want["correct_values"]).abs().max().item()
        count_gap = max(count_gap, gap)
        slack = (
            0
            if device == "cpu"
            else max(CUDA_ACCEPTANCE_MIN_SLACK, CUDA_ACCEPTANCE_SLACK * want["total_values"].max().item())
        )
        ok = ok and gap <= slack and torch.equal(got["total_values"], want["total_values"])
    return {"mtp_loss": loss_error, "acceptance_gap": count_gap}, ok


def run_mtp_parity(scenarios, setup, mtp_layers: int, rtol: float, json_path: str | None) -> int:
    world_size = world_size_for(setup.device, scenarios)
    print(
        f"A/B parity with {mtp_layers} MTP layer(s) on {setup.device} ({world_size} processes per side): "
        f"verl as it ships (fused off with MTP) vs hook mode (backend={setup.backend}, MTP loss through the op)",
        flush=True,
    )
    started = time.time()
    backend = backend_for(setup.device)
    if world_size == 1:
        ranks = run_in_processes(both_sides_worker, 1, scenarios, setup, mtp_layers, backend=backend)
        runs = {side: [rank[side] for rank in ranks] for side in SIDES}
    else:
        runs = {
            side: run_in_processes(side_worker, world_size, side, scenarios, setup, mtp_layers, backend=backend)
            for side in SIDES
        }
    print(f"both sides ran in {time.time() - started:.1f}s (process start-ups included)", flush=True)
    report = {
        "device": setup.device,
        "backend": setup.backend,
        "dtype": setup.dtype,
        "mtp_layers": mtp_layers,
        "rtol": rtol,
        "scenarios": [],
    }
    print(f"\n{TABLE_HEADER}")
    for scenario in scenarios:
        name = scenario.name
        rows = compare_runs(runs["verl"], name, runs["hook"], name, relative=True)
        metrics, metrics_ok = metric_rows(runs["verl"], runs["hook"], name, setup.device)
        fused = {side: runs[side][0][name]["fused"] for side in SIDES}
        mtp_grads = any(key.startswith("mtp.") for key in runs["hook"][0][name]["grads"])
        match = (
            fused == {"verl": False, "hook": True}
            and within(rows, rtol)
            and metrics["mtp_loss"] <= rtol
            and metrics_ok
            and mtp_grads
        )
        peaks = {side: max(r[name]["peak_bytes"] for r in runs[side]) for side in SIDES}
        report["scenarios"].append(
            {"scenario": name, "fused": fused, "vs_verl_rel": rows, "mtp": metrics, "peak_bytes": peaks, "match": match}
        )
        print(comparison_row(name, "hook vs verl's MTP path (rel)", rows, "" if match else "   MISMATCH"))
        print(
            f"{'':<18} {'MTP loss (rel), acceptance':<28} {metrics['mtp_loss']:>10.3g} "
            f"{metrics['acceptance_gap']:>10.3g}"
            f"   fused kernels: verl {fused['verl']}, hook {fused['hook']}"
        )
    report["match"] = all(entry["match"] for entry in report["scenarios"])
    print()
    print(
        f"PASS: hook mode's fused MTP loss within {rtol:g} of verl's MTP path"
        if report["match"]
        else "FAIL: mismatches above"
    )
    if json_path:
        write_json(report, json_path)
    return 0 if report["match"] else 1
