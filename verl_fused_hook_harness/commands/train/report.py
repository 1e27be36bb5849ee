"""train-parity's report: one JSON written after every finished run, its checks, its tables, and merging reports.

Why after every run: a device call that is cut off by its time limit must
leave every finished run on disk, so a long comparison can be split over
several calls (different modes, offload on or off) and put back together with
`--merge`, which evaluates the identities across all of them. The report file
is the single record: the runner adds each finished run to it
(`add_runs`), and the tables, checks and plot are redrawn from it each time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from ...support.reports import pyplot
from .modes import LEGACY, MODES, one_kernel_mode, ordered_modes

logger = logging.getLogger(__name__)

REPORT_NAME = "train_parity.json"
# What must agree for two runs to be compared step by step (a merge refuses reports that differ in any).
CONFIGURATION_FIELDS = (
    "device", "tp", "dtype", "steps", "hf_config", "shape", "micro_batch", "seed", "checkpoint_step", "deterministic",
)  # fmt: skip
IDENTITY_FIELDS = ("loss", "grad_norm", "param_checksum")

# Per step, the absolute loss gap (GRPO losses sit near 0, so a relative gap means nothing) and the gradient
# norm's gap relative to the reference.
# - another kernel than legacy's (hook-auto on CUDA, hook-auto-mask, hook-auto-fused-loss) vs legacy;
# - the fused loss vs its twin (hook-auto: the same forward kernel family, the gradient formed in the forward).
# fp32 (CPU): every kernel is exact to fp32 rounding, so the gaps stay at that level at every step.
# bf16 (CUDA): at step 1 the weights are the same and the gap is the kernels' own: log-probs within 3e-5 of
# fp64, gradients 2.3e-3 (ours) and 5.5e-3 (verl's hidden gradient) relative, so the gradient norms agree
# within 5e-3. From step 2 on the weights differ by that rounding, and the gradient norm of this randomly
# initialised model amplifies any difference: a legacy run whose only change is PyTorch's non-deterministic
# (atomic-add) reductions drifts as far (docs/benchmarks.md), so only the loss is bounded there.
GAP_BOUNDS = {
    "vs legacy": {
        "float32": {"loss_abs": 1e-4, "grad_norm_rel": 1e-3},
        "bfloat16": {"loss_abs": 1e-3, "first_grad_norm_rel": 5e-3},
    },
    "vs twin": {
        "float32": {"loss_abs": 1e-6, "grad_norm_rel": 1e-5},
        "bfloat16": {"loss_abs": 1e-3, "first_grad_norm_rel": 5e-3},
    },
}
_BOUND_TEXT = {
    "loss_abs": "loss within {:g} (absolute)",
    "grad_norm_rel": "grad norm within {:g} (relative)",
    "first_grad_norm_rel": "step-1 grad norm within {:g} (relative)",
}


# ---------------------------------------------------------------- one run's rows


def merge_ranks(per_rank: list[dict]) -> dict:
    """One row per step and run: the loss, grad norm and fused-loss calls of the first rank that has a loss (rank 0;
    under PP the last stage's first rank); the checksum over all ranks' checksums."""
    merged = {}
    for key, rows in per_rank[0].items():
        merged[key] = []
        for index in range(len(rows)):
            ranks = [r[key][index] for r in per_rank]
            row = next((r for r in ranks if r["loss"] is not None), ranks[0])
            combined = hashlib.sha256("".join(r["param_checksum"] for r in ranks).encode()).hexdigest()
            merged[key].append(
                row
                | {
                    "param_checksum": combined,
                    "param_sum": sum(r["param_sum"] for r in ranks),
                    "peak_bytes": max((r["peak_bytes"] or 0) for r in ranks) or None,
                }
            )
    return merged


def identical(rows_a: list[dict], rows_b: list[dict]) -> tuple[bool, list[int]]:
    """Bitwise equality of loss, grad norm and checksum on the steps both runs have; the steps that differ."""
    by_step = {row["step"]: row for row in rows_a}
    differ = [row["step"] for row in rows_b if any(by_step[row["step"]][f] != row[f] for f in IDENTITY_FIELDS)]
    return not differ, differ


def largest_gap(reference: list[dict], other: list[dict]) -> dict:
    """Largest absolute loss gap and relative grad-norm gap to the reference over all steps, and both per step."""
    per_step = []
    for a, b in zip(reference, other):
        norm_gap = abs(a["grad_norm"] - b["grad_norm"]) / max(abs(a["grad_norm"]), 1e-12)
        per_step.append({"step": a["step"], "loss_abs": abs(a["loss"] - b["loss"]), "grad_norm_rel": norm_gap})
    return {
        "loss_abs": max(r["loss_abs"] for r in per_step),
        "grad_norm_rel": max(r["grad_norm_rel"] for r in per_step),
        "first_grad_norm_rel": per_step[0]["grad_norm_rel"] if per_step else 0.0,
        "per_step": per_step,
    }


# ---------------------------------------------------------------- checks


def _identity_check(label: str, a: list[dict], b: list[dict]) -> dict:
    ok, steps = identical(a, b)
    return {"check": label, "ok": ok, "differing_steps": steps}


def _gap_check(label: str, reference: list[dict], other: list[dict], bound: dict) -> tuple[dict, dict]:
    gap = largest_gap(reference, other)
    ok = all(gap[k] <= bound[k] for k in bound)
    exact, _ = identical(reference, other)
    text = f"{label}: " + ", ".join(_BOUND_TEXT[k].format(v) for k, v in bound.items())
    return {"check": text, "ok": ok, "largest": {k: gap[k] for k in bound}, "bitwise_identical": exact}, gap


def _fused_loss_check(key: str, rows: list[dict], micro_batches: int) -> list[dict]:
    """A fused-loss mode ran ppo_loss inside the op on every micro-batch of every step; other modes never."""
    calls = [row.get("fused_loss_calls") for row in rows]
    if MODES[key.split("/")[0]].fused_loss:
        wrong = [row["step"] for row, n in zip(rows, calls) if n != micro_batches]
        return [
            {
                "check": f"{key}: ppo_loss inside the op ({micro_batches} calls a step)",
                "ok": not wrong,
                "differing_steps": wrong,
                "passed_as": "every step",
            }
        ]
    wrong = [row["step"] for row, n in zip(rows, calls) if n]
    return [{"check": f"{key}: ppo_loss outside the op", "ok": False, "differing_steps": wrong}] if wrong else []


def _on_policy_check(key: str, rows: list[dict], packings: str) -> dict:
    """Exact on-policy: every token's log-prob the same bits in both packings (the same sequences, the same
    weights, before the update), and the update recomputed the old log-probs to the bit, so every micro-batch's
    PPO KL and clip fraction is exactly 0 on every step."""
    wrong = [
        row["step"]
        for row in rows
        if not row.get("ppo_kl")
        or any(v != 0.0 for v in row["ppo_kl"] + (row.get("pg_clipfrac") or []))
        or row.get("packing_max_abs") != 0.0
    ]
    label = (
        f"{key}: on-policy ({packings}): every token's log-prob the same in both packings, actor/ppo_kl and "
        "actor/pg_clipfrac exactly 0"
    )
    return {"check": label, "ok": not wrong, "differing_steps": wrong, "passed_as": "every step"}


def evaluate(runs: dict, configuration: dict, run_info: dict | None = None) -> dict:
    """Every identity and bounded gap that the runs present allow, and the runs still missing for the rest.

    Per mode: offload on == off, resumed == the run its checkpoint came from (steps K/2+1..K); vs legacy:
    identical for the mode computing with legacy's kernel, else the gap within GAP_BOUNDS["vs legacy"];
    a mode with a twin (the fused loss) also within GAP_BOUNDS["vs twin"] of it. Under megatron's
    batch_invariant_mode with the old log-probs in another packing: every run exactly on-policy."""
    run_info = run_info or {}
    dtype, device = configuration["dtype"], configuration["device"]
    resumed_steps = f"steps {configuration['checkpoint_step'] + 1}-{configuration['steps']}"
    checks, gaps, pending = [], {}, []
    legacy = runs.get(f"{LEGACY}/offload-off")
    micro_batches = configuration["shape"]["prompts"] * configuration["shape"]["n"] // configuration["micro_batch"]
    for key, rows in runs.items():
        checks += _fused_loss_check(key, rows, micro_batches)
    old_micro = configuration.get("old_log_prob_micro_batch")
    if configuration.get("batch_invariant") and old_micro is not None:
        packings = f"old log-probs in micro-batches of {old_micro}, the update in {configuration['micro_batch']}"
        checks += [_on_policy_check(key, rows, packings) for key, rows in runs.items()]
    for name in ordered_modes({key.split("/")[0] for key in runs}):
        plain = runs.get(f"{name}/offload-off")
        if f"{name}/offload-on" in runs and plain is not None:
            checks.append(_identity_check(f"{name}: offload on == off", plain, runs[f"{name}/offload-on"]))
        if f"{name}/resumed" in runs:
            origin = run_info.get(f"{name}/resumed", {}).get("resumes", f"{name}/offload-off")
            if origin in runs:
                label = f"{name}: resumed == uninterrupted ({resumed_steps})"
                checks.append(_identity_check(label, runs[origin], runs[f"{name}/resumed"]))
            else:
                pending.append(f"{origin} (for {name}: resumed == uninterrupted)")
        elif plain is not None:
            pending.append(f"{name}/resumed (for {name}: resumed == uninterrupted)")
        if plain is None:
            pending.append(f"{name}/offload-off (for {name}'s offload and legacy comparisons)")
            continue
        if name != LEGACY:
            if legacy is None:
                pending.append(f"{LEGACY}/offload-off (for {name} vs legacy)")
            elif name == one_kernel_mode(device):
                checks.append(_identity_check(f"{name} == legacy (one kernel)", legacy, plain))
            else:
                check, gaps[f"{name} vs {LEGACY}"] = _gap_check(
                    f"{name} vs legacy", legacy, plain, GAP_BOUNDS["vs legacy"][dtype]
                )
                checks.append(check)
        twin = MODES[name].twin
        if twin is not None:
            if f"{twin}/offload-off" not in runs:
                pending.append(f"{twin}/offload-off (for {name} vs {twin})")
            else:
                check, gaps[f"{name} vs {twin}"] = _gap_check(
                    f"{name} vs {twin}", runs[f"{twin}/offload-off"], plain, GAP_BOUNDS["vs twin"][dtype]
                )
                checks.append(check)
    return {"checks": checks, "gaps": gaps, "pending": pending, "match": all(c["ok"] for c in checks)}


# ---------------------------------------------------------------- tables and sentences


def summary_rows(runs: dict, run_info: dict) -> list[dict]:
    """Per run: wall time and its parts, first step and mean step after it, peak memory, last loss."""
    rows = []
    for key, steps in runs.items():
        info = run_info.get(key, {})
        timed = [r["seconds"] for r in steps[1:]]
        peaks = [r["peak_bytes"] for r in steps if r["peak_bytes"]]
        rows.append({
            "run": key, "steps": len(steps), "wall_s": info.get("wall_s"), "build_s": info.get("build_s"),
            "checkpoint_s": info.get("save_s") or info.get("load_s"), "first_step_s": steps[0]["seconds"],
            "mean_step_s": sum(timed) / len(timed) if timed else None,
            "peak_gib": max(peaks) / 2**30 if peaks else None, "last_loss": steps[-1]["loss"],
        })  # fmt: skip
    return rows


KERNEL_ACCURACY = {
    # measured against fp64 (N=2048, H=4096, V=151936; docs/op.md, docs/benchmarks.md)
    "cuda": {
        "hook-auto": "this package's Triton kernel, where legacy runs verl's: both give log-probs within 2.9e-5 and "
        "entropy within 1.1e-5 of fp64, but their gradients round differently (ours 2.3e-3 relative, verl's "
        "hidden gradient 5.5e-3: it accumulates in bf16)",
        "hook-auto-mask": "this package's Triton kernel on the rows ppo_loss reads only (log-probs 2.9e-5, entropy "
        "1.1e-5, gradients 2.3e-3 relative against fp64; verl's kernel: 5.5e-3 on the hidden gradient)",
        "hook-auto-fused-loss": "ppo_loss inside the op: hook-auto's Triton forward kernel (log-probs 2.9e-5, "
        "entropy 1.1e-5 against fp64), which also keeps each chunk's logits (fp16 differences to their tile's max) so "
        "that both input gradients are formed in the forward (hidden gradient 2.46e-3, weight gradient 2.52e-3 "
        "relative against fp64), where hook-auto recomputes the logits in its backward (2.3e-3) and legacy runs "
        "verl's kernel (hidden gradient 5.5e-3)",
    },
    "cpu": {
        "hook-auto": "the portable op, as legacy here (its Triton kernel is swapped for it on the CPU)",
        "hook-auto-mask": "the portable op on the rows ppo_loss reads only; a row's arithmetic does not depend on "
        "which other rows are computed",
        "hook-auto-fused-loss": "ppo_loss inside the portable op: each chunk's logit gradient is formed in the "
        "forward from the per-row loss gradient instead of in the backward from the one autograd brings, the "
        "same products in fp32",
    },
}


def explanation(pair: str, gap: dict, device: str, dtype: str) -> str:
    """One sentence: how large the measured gap of `pair` ("mode vs reference") is, and why."""
    name, reference = pair.split(" vs ")
    first, worst = gap["per_step"][0], max(gap["per_step"], key=lambda r: r["loss_abs"])
    if gap["loss_abs"] == 0 and gap["grad_norm_rel"] == 0:
        return f"- {pair}: identical loss and gradient norm at every step ({KERNEL_ACCURACY[device][name]})."
    drift = "bf16 parameters round every update" if dtype == "bfloat16" else "every update carries the difference on"
    return (
        f"- {pair}: {name} computes with {KERNEL_ACCURACY[device][name]}. Step {first['step']} starts from the same "
        f"weights, so its loss gap ({first['loss_abs']:.1e}) and gradient-norm gap ({first['grad_norm_rel']:.1e}) "
        f"are that rounding alone; from then on the weights differ by the gradients' rounding and {drift}, so the "
        f"gap reaches {worst['loss_abs']:.1e} at step {worst['step']} (largest gradient-norm gap "
        f"{gap['grad_norm_rel']:.1e})."
    )


def twin_timing(summary: list[dict]) -> list[str]:
    """Per mode with a twin (the fused loss on vs off): mean step time and peak memory side by side."""
    by_run = {row["run"]: row for row in summary}
    lines = []
    for mode in MODES.values():
        ours, theirs = by_run.get(f"{mode.name}/offload-off"), by_run.get(f"{mode.twin}/offload-off")
        if mode.twin is None or ours is None or theirs is None or not (ours["mean_step_s"] and theirs["mean_step_s"]):
            continue
        line = (
            f"- {mode.name} vs {mode.twin} (offload off, steps after the first): {ours['mean_step_s']:.3f} s vs "
            f"{theirs['mean_step_s']:.3f} s a step ({ours['mean_step_s'] / theirs['mean_step_s']:.2f}x)"
        )
        if ours["peak_gib"] and theirs["peak_gib"]:
            line += f", peak memory {ours['peak_gib']:.2f} vs {theirs['peak_gib']:.2f} GiB"
        lines.append(line + ".")
    return lines


def _seconds(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(report: dict) -> str:
    config = report["configuration"]
    lines = [
        f"# train-parity: {config['hf_config']} on {config['device']}, TP={config['tp']}, {config['dtype']}, "
        f"{config['steps']} steps (checkpoint after step {config['checkpoint_step']})",
        "",
    ]
    lines += [
        "| run | steps | wall (s) | build (s) | checkpoint save/load (s) | first step (s) | mean step after "
        "the first (s) | peak memory (GiB) | last loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["summary"]:
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        lines.append(
            f"| {row['run']} | {row['steps']} | {_seconds(row['wall_s'])} | {_seconds(row['build_s'])} | "
            f"{_seconds(row['checkpoint_s'])} | {_seconds(row['first_step_s'])} | "
            f"{_seconds(row['mean_step_s'])} | {peak} | {row['last_loss']:.6g} |"
        )
    timing = twin_timing(report["summary"])
    if timing:
        lines += ["", "Time per step with the loss inside the op:", "", *timing]
    evaluation = report["evaluation"]
    lines += ["", "| check | result |", "|---|---|"]
    for check in evaluation["checks"]:
        detail = check.get("passed_as", "identical") if check["ok"] and "largest" not in check else ""
        if "largest" in check:
            detail = ", ".join(f"{k} {v:.2e}" for k, v in check["largest"].items())
            detail += " (bitwise identical)" if check["bitwise_identical"] else ""
        elif not check["ok"]:
            detail = f"differs at steps {check['differing_steps']}"
        lines.append(f"| {check['check']} | {'PASS' if check['ok'] else 'FAIL'}: {detail} |")
    if evaluation["pending"]:
        lines += ["", "Not evaluated yet, runs missing (run them, then `--merge` the reports):"]
        lines += [f"- {item}" for item in evaluation["pending"]]
    gaps = evaluation["gaps"]
    if gaps:
        pairs = list(gaps)
        lines += [
            "",
            "Per-step gaps (loss absolute, gradient norm relative):",
            "",
            "| step | " + " | ".join(f"{p}: loss | {p}: grad norm" for p in pairs) + " |",
            "|---|" + "---|---|" * len(pairs),
        ]
        for index, row in enumerate(gaps[pairs[0]]["per_step"]):
            cells = [
                f"{gaps[p]['per_step'][index]['loss_abs']:.2e} | {gaps[p]['per_step'][index]['grad_norm_rel']:.2e}"
                for p in pairs
            ]
            lines.append(f"| {row['step']} | " + " | ".join(cells) + " |")
        lines += ["", "Why the gaps:", ""]
        lines += [explanation(p, gaps[p], config["device"], config["dtype"]) for p in pairs]
    return "\n".join(lines) + "\n"


def plot(runs: dict, path: Path) -> bool:
    """Loss and gradient-norm curves; False (and a log line) when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        logger.warning("train-parity: matplotlib is not installed, no %s; `--merge` the report where it is", path.name)
        return False
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, steps in runs.items():
        if "offload-on" in key:
            continue
        style = "--" if key.endswith("resumed") else "-"
        x = [r["step"] for r in steps]
        axes[0].plot(x, [r["loss"] for r in steps], style, marker=".", label=key)
        axes[1].plot(x, [r["grad_norm"] for r in steps], style, marker=".", label=key)
    axes[0].set(xlabel="step", ylabel="loss (ppo_loss, summed over micro-batches)")
    axes[1].set(xlabel="step", ylabel="gradient norm")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return True


# ---------------------------------------------------------------- the report file


def _complete(report: dict) -> dict:
    report["summary"] = summary_rows(report["runs"], report["run_info"])
    report["evaluation"] = evaluate(report["runs"], report["configuration"], report["run_info"])
    return report


def new_report(configuration: dict) -> dict:
    missing = [f for f in CONFIGURATION_FIELDS if f not in configuration]
    if missing:
        raise ValueError(f"train-parity report: configuration lacks {missing}")
    return _complete({"configuration": dict(configuration), "runs": {}, "run_info": {}})


def write(report: dict, folder: Path) -> None:
    """JSON (replaced atomically: a process killed mid-write leaves the previous file), markdown, plot."""
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / (REPORT_NAME + ".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(partial, folder / REPORT_NAME)
    (folder / "train_parity.md").write_text(markdown(report))
    if report["runs"]:
        plot(report["runs"], folder / "train_parity.png")


def read(path: Path) -> dict:
    """A report from its folder or its JSON file."""
    path = Path(path)
    file = path / REPORT_NAME if path.is_dir() else path
    if not file.exists():
        raise ValueError(f"--merge: {file} does not exist; pass a folder holding {REPORT_NAME} or the file itself")
    report = json.loads(file.read_text())
    report.setdefault("run_info", {})
    if "configuration" not in report:
        raise ValueError(f"--merge: {file} has no 'configuration' (written by an older train-parity); run it again")
    return report


def add_runs(folder: Path, runs: dict, run_info: dict) -> dict:
    """Add finished runs to the report in `folder` (written by `new_report` + `write` at the start) and rewrite it."""
    report = read(folder)
    report["runs"].update(runs)
    report["run_info"].update(run_info)
    write(_complete(report), folder)
    return report


def merge(reports: list[tuple[str, dict]]) -> dict:
    """One report from several (name, report) of the same configuration; a run found twice must be identical."""
    first_name, first = reports[0]
    merged = new_report(first["configuration"])
    for name, report in reports:
        for field in CONFIGURATION_FIELDS:
            if report["configuration"].get(field) != first["configuration"][field]:
                raise ValueError(
                    f"--merge: {name} has {field}={report['configuration'].get(field)!r}, {first_name} has "
                    f"{first['configuration'][field]!r}; only runs of one configuration compare step by step"
                )
        for key, rows in report["runs"].items():
            if key in merged["runs"]:
                earlier = merged["runs"][key]
                if [r["step"] for r in earlier] != [r["step"] for r in rows]:
                    raise ValueError(f"--merge: run {key} of {name} has other steps than an earlier report's")
                same, steps = identical(earlier, rows)
                if not same:
                    raise ValueError(f"--merge: run {key} of {name} differs from an earlier report's at steps {steps}")
                logger.warning(
                    "--merge: run %s of %s repeats an earlier report's bit for bit; the first is kept", key, name
                )
                continue
            merged["runs"][key] = rows
            merged["run_info"][key] = report["run_info"].get(key, {})
    return _complete(merged)
