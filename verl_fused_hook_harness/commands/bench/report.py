"""The op benchmark's report: its markdown tables and its plot, drawn from the results (the JSON `bench` writes).

Why apart from the measuring: the tables and the plot are redrawn from a finished run's JSON (`bench
--plot-only`), on any machine, without CUDA.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from ...support.reports import on_device, pyplot
from .clocks import clocks_table


def _fmt(value, reference=None):
    """'12.3 ms (1.05x)' against a reference time, '12.3 ms' without one, or why there is no number."""
    if not isinstance(value, float):
        if value is None:
            return "n/a"
        return "OOM" if str(value).startswith("out of memory") else "failed"
    return f"{value:.1f} ms ({value / reference:.2f}x)" if reference else f"{value:.1f} ms"


def _at_clock(reading: dict | None) -> str:
    """', 1740 MHz': the median SM clock of a step's forward rounds, where the run recorded one. On an H100 at its
    power cap the clock moves by up to 30% from one step to the next in the same rounds, and a ratio with it."""
    return f", {reading['sm_clock_mhz']:.0f} MHz" if reading and "sm_clock_mhz" in reading else ""


def markdown(results: dict) -> str:
    names = [m for m in results["methods"] if m != "floor"]
    card = on_device(results)
    lines = [
        f"Forward+backward {card} (ratio to the 4-GEMM cuBLAS floor) / extra memory beyond inputs and returned "
        "gradients (fused_loss*, verl_loss*: the output layer plus verl's ppo_loss, vanilla or _gspo):",
        "",
        "| N, H, V | floor | 3-GEMM floor | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    if any(name in names for name in ("kl_topk", "verl_kl_topk", "verl_kl_topk_chunked")):
        lines[1:1] = [
            "",
            f"kl_topk, verl_kl_topk*: the output layer plus verl's forward_kl_topk at the teacher's top-"
            f"{results.get('topk')} (verl_kl_topk_chunked: verl's use_chunked_topk path).",
        ]
    if results.get("back_to_back", 1) > 1:
        lines[1:1] = [
            "",
            f"Each timing: {results['back_to_back']} calls back to back (the GPU held at its power cap, as "
            "inside a training step); times per call.",
        ]
    for row in results["shapes"]:
        floor = row.get("floor", {}).get("fwd_bwd_ms")
        cells = [_fmt(row.get("floor", {}).get("fwd_bwd_3gemm_ms"), floor)]
        for name in names:
            r = row.get(name, {})
            mem = r.get("extra_gib")
            cells.append(_fmt(r.get("fwd_bwd_ms"), floor) + (f", +{mem:.2f} GiB" if isinstance(mem, float) else ""))
        lines.append(f"| {row['N']}, {row['H']}, {row['V']} | {_fmt(floor)} | " + " | ".join(cells) + " |")
    out_of_memory = {
        name: [
            row["N"]
            for row in results["shapes"]
            if str(row.get(name, {}).get("fwd_bwd_ms", "")).startswith("out of memory")
        ]
        for name in names
    }
    if any(out_of_memory.values()):
        lines += [""] + [f"- {name}: OOM at N={', '.join(map(str, ns))}" for name, ns in out_of_memory.items() if ns]
    for fused_name, verl_name in (("fused_loss", "verl_loss"), ("fused_loss_gspo", "verl_loss_gspo")):
        if not {fused_name, verl_name} <= set(names):
            continue
        lines += ["", f"{fused_name} speed-up over {verl_name} (verl's kernel + its ppo_loss) {card}:", ""]
        for row in results["shapes"]:
            fused, verl = row.get(fused_name, {}).get("fwd_bwd_ms"), row.get(verl_name, {}).get("fwd_bwd_ms")
            if isinstance(fused, float) and isinstance(verl, float):
                lines.append(f"- {row['N']}, {row['H']}, {row['V']}: {verl / fused:.2f}x")
    lines += [
        "",
        f"Forward without gradient {card} (ratio to one GEMM, timed in the same rounds where the run has it):",
        "",
        "| N, H, V | one GEMM | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for row in results["shapes"]:
        gemm = row.get("one_gemm_in_rounds_ms")
        if not isinstance(gemm, float):  # runs before the forward's own rounds, or a GEMM that failed in them
            gemm = row.get("floor", {}).get("gemm_ms")
        cells = [_fmt(row.get(n, {}).get("fwd_ms"), gemm) + _at_clock(row.get(n, {}).get("fwd_clock")) for n in names]
        gemm_cell = _fmt(gemm) + _at_clock(row.get("one_gemm_in_rounds_clock"))
        lines.append(f"| {row['N']}, {row['H']}, {row['V']} | {gemm_cell} | " + " | ".join(cells) + " |")
    masked = [m for m in names if any("half_masked_fwd_bwd_ms" in row.get(m, {}) for row in results["shapes"])]
    if masked:
        lines += [
            "",
            f"Half the rows masked by score_mask, forward+backward {card} (ratio to the unmasked time):",
            "",
            "| N, H, V | " + " | ".join(masked) + " |",
            "|---|" + "---|" * len(masked),
        ]
        for row in results["shapes"]:
            cells = []
            for name in masked:
                r = row.get(name, {})
                full, half = r.get("fwd_bwd_ms"), r.get("half_masked_fwd_bwd_ms")
                cells.append(_fmt(half, full) if isinstance(full, float) else _fmt(half))
            lines.append(f"| {row['N']}, {row['H']}, {row['V']} | " + " | ".join(cells) + " |")
    lines += clocks_table(results)
    if results.get("clocks_not_recorded"):
        lines += ["", f"SM clock and power not recorded: {results['clocks_not_recorded']}."]
    if results.get("accuracy"):
        n, h, v = results["accuracy_shape"]
        lines += [
            "",
            f"Accuracy against fp64 {card} (N={n}, H={h}, V={v}, T={results['temperature']}):",
            "",
            "| method | log-prob max err | entropy max err | loss rel err | d_hidden rel err | d_weight rel err |",
            "|---|---|---|---|---|---|",
        ]
        sci = lambda value: "n/a" if value is None else f"{value:.2e}"  # noqa: E731
        for name, acc in results["accuracy"].items():
            if isinstance(acc, dict):
                lines.append(
                    f"| {name} | {sci(acc['log_prob_max_err'])} | {sci(acc['entropy_max_err'])} | "
                    f"{sci(acc.get('loss_rel_err'))} | {sci(acc['d_hidden_rel_err'])} | "
                    f"{sci(acc['d_weight_rel_err'])} |"
                )
            else:
                lines.append(f"| {name} | {acc} | | | | |")
    skipped = results.get("skipped") or {}
    if skipped:  # methods asked for that cannot run here, and why
        lines += [""] + [f"Skipped {name}: {reason}." for name, reason in skipped.items()]
    return "\n".join(lines) + "\n"


RATIO_TICKS = (0.75, 1, 1.25, 1.5, 2, 3, 5, 10, 20, 50)


def floor_ratio(row: dict, method: str) -> float | None:
    """The method's forward+backward time over the 4-GEMM floor measured in the same run, or None."""
    time, floor = row.get(method, {}).get("fwd_bwd_ms"), row.get("floor", {}).get("fwd_bwd_ms")
    return time / floor if isinstance(time, float) and isinstance(floor, float) and floor > 0 else None


def three_gemm_ratio(row: dict) -> float | None:
    """The 3-GEMM floor (logits once: a fused loss's lower bound) over the 4-GEMM floor, or None."""
    floor = row.get("floor", {})
    three = floor.get("fwd_bwd_3gemm_ms")
    if three is None and {"gemm_ms", "dx_ms", "dw_ms"} <= floor.keys():  # runs from before the key existed
        three = floor["gemm_ms"] + floor["dx_ms"] + floor["dw_ms"]
    return three / floor["fwd_bwd_ms"] if three and floor.get("fwd_bwd_ms") else None


TITLE_CHARACTERS_PER_INCH = 14  # 9-point text: a line this long fits the figure's width


def figure_title(results: dict, width_inches: float) -> str:
    """The device, dtype, temperature and the whole command, folded into lines the figure's width holds (a
    command of many shapes ran past both edges, its start lost)."""
    text = f"{results['device']}, bf16, T={results['temperature']}: {results.get('command', '')}"
    return textwrap.fill(text, width=int(TITLE_CHARACTERS_PER_INCH * width_inches), break_on_hyphens=False)


def plot(results: dict, path: Path) -> None:
    """Per shape, one bar per method of this run (peers included): forward+backward time over the 4-GEMM cuBLAS
    floor measured in the same run (left, the 3-GEMM floor marked), and the extra memory (right). Methods that
    failed or ran out of memory at a shape are marked there."""
    plt = pyplot()
    if plt is None:
        raise SystemExit("bench: the plot needs matplotlib (pip install matplotlib)")
    shapes = results["shapes"]
    names = [m for m in results["methods"] if m != "floor"]
    labels = [f"{row['N']:,}\nH={row['H']}\nV={row['V']:,}" for row in shapes]
    width = 0.8 / max(1, len(names))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    figure, (ratio_axis, memory_axis) = plt.subplots(1, 2, figsize=(max(12, 1.6 * len(shapes) * 2), 5.5))
    for index, name in enumerate(names):
        offset = (index - (len(names) - 1) / 2) * width
        color = colors[index % len(colors)]
        for shape_index, row in enumerate(shapes):
            x = shape_index + offset
            ratio = floor_ratio(row, name)
            memory = row.get(name, {}).get("extra_gib")
            if ratio is None:
                ratio_axis.text(x, 1.0, "x", color=color, ha="center", va="bottom", fontsize=8)
            else:
                ratio_axis.bar(x, ratio, width, color=color, label=name if shape_index == 0 else None)
                ratio_axis.text(x, ratio, f"{ratio:.2f}", ha="center", va="bottom", fontsize=6, rotation=90)
            if isinstance(memory, float):
                memory_axis.bar(x, memory, width, color=color, label=name if shape_index == 0 else None)
            elif "extra_gib" in row.get(name, {}) or ratio is None:
                memory_axis.text(
                    x,
                    0,
                    "x",
                    color=color,
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    transform=memory_axis.get_xaxis_transform(),
                )
    for shape_index, row in enumerate(shapes):
        three = three_gemm_ratio(row)
        if three:
            ratio_axis.hlines(three, shape_index - 0.45, shape_index + 0.45, colors="gray", linestyles="dotted")
    ratio_axis.axhline(1.0, color="black", linewidth=0.8)
    ratio_axis.set_yscale("log")
    ratio_axis.minorticks_off()
    ticks = [t for t in RATIO_TICKS if t <= 1.2 * max([p.get_height() for p in ratio_axis.patches] or [1.0])]
    ratio_axis.set_yticks(ticks, [f"{t:g}" for t in ticks])
    ratio_axis.set_title("fwd+bwd time / 4-GEMM cuBLAS floor (dotted: 3 GEMMs; x: OOM or failed)", fontsize=10)
    memory_axis.set_title("extra memory beyond inputs and returned gradients (GiB; x: not measured)", fontsize=10)
    if memory_axis.patches:
        memory_axis.set_yscale("log")
    else:
        memory_axis.text(0.5, 0.5, "not measured (--quick)", ha="center", va="center", transform=memory_axis.transAxes)
    for axis in (ratio_axis, memory_axis):
        axis.set_xticks(range(len(shapes)), labels, fontsize=8)
        axis.set_xlabel("N (tokens), H, V")
        axis.grid(True, axis="y", which="both", alpha=0.3)
        if axis.patches:
            axis.legend(fontsize=8)
    figure.suptitle(figure_title(results, figure.get_figwidth()), fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
