"""ab-parity with pipeline, virtual pipeline and expert parallelism (`--pp`, `--vpp`, `--ep`, `--moe-experts`).

Where the TP scenarios compare one engine forward, these layouts only exist inside megatron's pipeline schedule,
so each side runs verl's real `train_batch` (support/parallel_engine.py): `forward_backward_batch` through the
1F1B or interleaved schedule on packed GRPO micro-batches of different lengths (each DP rank its own), DDP and
the optimizer. Sides: verl's legacy fused forward (`VERL_FUSED_USE_OP_HOOK=0`; on the CPU its kernel swapped
for the portable op), hook mode (`=1`, `--backend`), verl's unfused path (fused kernels off), and the same
model without the pipeline or expert split (PP=1, EP=1: weights drawn by global layer and expert), which is
what sees a stage handed the wrong hidden states. Compared on every rank: each micro-batch's loss, every metric
verl returns, the response log-probs and entropy, every parameter gradient.

Checks: hook vs legacy identical where both use one kernel (the CPU, or `--backend verl`), else within the
kernels' accuracy; hook and legacy within the unfused tolerance of verl's unfused path; verl's unfused path
within 1e-5 of the unsplit model (fp32; on CUDA the unfused tolerance). Runs in fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

from ...support.parallel_compare import worst_errors
from ...support.parallel_engine import HOOK, LEGACY, REFERENCE, UNFUSED, CaseRun, ParallelCase, run_launch
from ...support.reports import write_json
from .scenarios import TWO_KERNEL_GRAD_RTOL, TWO_KERNEL_VALUE_TOL, UNFUSED_RTOL, UNFUSED_RTOL_CUDA

SPLIT_RTOL = 1e-5  # fp32: the pipeline and expert split change no arithmetic (measured 0 dense, 1e-6 with EP)
QUANTITIES = ("losses", "metrics", "log_probs", "entropy", "grads")


def parallel_flags_given(args) -> bool:
    return args.pp > 1 or args.vpp is not None or args.ep > 1 or args.moe_experts > 0


def check_parallel_args(parser, args, hf_path: str | None) -> None:
    """The flag combinations the parallel runs take (parser.error naming the flag otherwise)."""
    for flag, value in (("--pp", args.pp), ("--ep", args.ep)):
        if value < 1:
            parser.error(f"{flag}: expected an int >= 1, got {value}")
    if args.vpp is not None and (args.vpp < 2 or args.pp < 2):
        parser.error("--vpp: model chunks per stage (>= 2), with --pp >= 2")
    if args.moe_experts < 0 or (args.moe_experts and args.moe_experts % args.ep):
        parser.error(f"--moe-experts: expected 0 (dense) or a multiple of --ep ({args.ep}), got {args.moe_experts}")
    if args.ep > 1 and not args.moe_experts and hf_path is None:
        parser.error("--ep: expert parallelism needs an MoE model: --moe-experts N, or an MoE --hf-config")
    if args.layout == "bshd" or args.mtp_layers:
        parser.error(
            "--pp/--vpp/--ep/--moe-experts compare on the packed layout without MTP (the padded layout and "
            "MTP under PP and EP: tests/test_pipeline_parallel.py, tests/test_moe.py)"
        )
    if hf_path is not None:
        layers = json.loads((Path(hf_path) / "config.json").read_text())["num_hidden_layers"]
        if layers % (args.pp * (args.vpp or 1)):
            parser.error(
                f"--pp/--vpp: the model's {layers} layers do not split into {args.pp * (args.vpp or 1)} chunks"
            )


def parallel_case(args, hf_path: str | None, backend: str) -> ParallelCase:
    """The layout the flags ask for; data-parallel size = EP (each DP rank its own batch)."""
    tp = args.tp or 1
    return ParallelCase(
        name=f"tp{tp}/pp{args.pp}" + (f"/vpp{args.vpp}" if args.vpp else "") + f"/ep{args.ep}"
        + (f"/moe{args.moe_experts}" if args.moe_experts else ""),
        world=tp * args.pp * args.ep, tp=tp, pp=args.pp, vpp=args.vpp, ep=args.ep,
        layers=None if hf_path is not None else max(2, args.pp * (args.vpp or 1)),
        experts=args.moe_experts, backend=backend, hf_path=hf_path,
    )  # fmt: skip


def evaluate(per_rank: list[dict], one_kernel: bool, repeatable: bool, device: str) -> dict:
    """The worst error per quantity and comparison over every rank, and each comparison's verdict: hook vs
    legacy 0 with one kernel in bitwise-repeatable steps, the unfused tolerance with one kernel otherwise (MoE
    on CUDA), the kernels' accuracy with two."""
    unfused_rtol = UNFUSED_RTOL_CUDA if device == "cuda" else UNFUSED_RTOL
    split_rtol = UNFUSED_RTOL_CUDA if device == "cuda" else SPLIT_RTOL
    comparisons = {
        "hook vs legacy": (LEGACY, HOOK, False),
        f"hook vs {UNFUSED}": (UNFUSED, HOOK, False),
        f"legacy vs {UNFUSED}": (UNFUSED, LEGACY, False),
        f"{UNFUSED} vs unsplit model": (REFERENCE, UNFUSED, True),
    }
    rows = {}
    for label, (want, got, part) in comparisons.items():
        if not any(want in sides for sides in per_rank):
            continue  # no unsplit model where the case splits none (PP=1, EP=1)
        worst = dict.fromkeys(QUANTITIES, 0.0)
        for sides in per_rank:
            if want in sides:
                for key, value in worst_errors(sides[want], sides[got], gradients_of_got_only=part).items():
                    worst[key] = max(worst[key], value)
        if label == "hook vs legacy" and one_kernel and repeatable:
            bound, ok = "0 (one kernel)", all(value == 0.0 for value in worst.values())
        elif label == "hook vs legacy" and not one_kernel:
            bound = f"values {TWO_KERNEL_VALUE_TOL:g}, grads {TWO_KERNEL_GRAD_RTOL:g}"
            ok = worst["grads"] <= TWO_KERNEL_GRAD_RTOL and all(
                worst[k] <= TWO_KERNEL_VALUE_TOL for k in QUANTITIES[:4]
            )
        else:
            tolerance = split_rtol if part else unfused_rtol
            bound, ok = f"{tolerance:g}", all(value <= tolerance for value in worst.values())
        rows[label] = {"worst": worst, "bound": bound, "match": ok}
    return rows


def run_parallel_parity(case: ParallelCase, device: str, one_kernel: bool, json_path: str | None) -> int:
    """Every side of the case in one set of processes, the table, the verdict; exit status."""
    kernel = (
        "the portable op on both sides" if device == "cpu" else f"legacy: verl's kernel, hook: backend={case.backend}"
    )
    print(f"A/B parity, {case.name} on {device} ({case.world} processes, DP={case.dp}), fp32; {kernel}", flush=True)
    per_rank = run_launch([CaseRun(case, (LEGACY, HOOK, UNFUSED))], device=device)
    repeatable = device == "cpu" or not case.moe  # support/parallel_engine.repeatable_on_cuda
    if not repeatable:
        print(
            "MoE on CUDA: megatron's token unpermutation adds with atomics, so the steps are not bitwise "
            "repeatable; hook vs legacy is held to the unfused tolerance",
            flush=True,
        )
    rows = evaluate([rank[case.name] for rank in per_rank], one_kernel, repeatable, device)
    print(f"\n{'compared':<30}" + "".join(f"{name:>11}" for name in QUANTITIES) + "   bound")
    for label, row in rows.items():
        flag = "" if row["match"] else "   MISMATCH"
        print(f"{label:<30}" + "".join(f"{row['worst'][k]:>11.3g}" for k in QUANTITIES) + f"   {row['bound']}{flag}")
    match = all(row["match"] for row in rows.values())
    print("\nPASS" if match else "\nFAIL: mismatches above")
    if json_path:
        write_json({"case": case.__dict__, "device": device, "one_kernel": one_kernel, "comparisons": rows,
                    "match": match}, json_path)  # fmt: skip
    return 0 if match else 1
