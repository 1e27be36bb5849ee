"""The op benchmark's report: its markdown tables and its plot, drawn from the results (the JSON `bench` writes).

Why apart from the measuring: the tables and the plot are redrawn from a finished run's JSON (`bench
--plot-only`), on any machine, without CUDA.
"""

from __future__ import annotations

from pathlib import Path

from ..support.reports import pyplot


def _fmt(value, reference=None):
    """'12.3 ms (1.05x)' against a reference time, '12.3 ms' without one, or why there is no number."""
    if not isinstance(value, float):
        return "OOM" if value == "out of memory" else ("n/a" if value is None else "failed")
    return f"{value:.1f} ms ({value / reference:.2f}x)" if reference else f"{value:.1f} ms"


def markdown(results: dict) -> str:
    names = [m for m in results["methods"] if m != "floor"]
    lines = [
        "Forward+backward (ratio to the 4-GEMM cuBLAS floor) / extra memory beyond inputs and returned gradients"
        " (fused_loss, verl_loss: the output layer plus verl's ppo_loss):",
        "",
        "| N, H, V | floor | 3-GEMM floor | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for row in results["shapes"]:
        floor = row.get("floor", {}).get("fwd_bwd_ms")
        cells = [_fmt(row.get("floor", {}).get("fwd_bwd_3gemm_ms"), floor)]
        for name in names:
            r = row.get(name, {})
            mem = r.get("extra_gib")
            cells.append(_fmt(r.get("fwd_bwd_ms"), floor) + (f", +{mem:.2f} GiB" if isinstance(mem, float) else ""))
        lines.append(f"| {row['N']}, {row['H']}, {row['V']} | {_fmt(floor)} | " + " | ".join(cells) + " |")
    if {"fused_loss", "verl_loss"} <= set(names):
        lines += ["", "fused_loss speed-up over verl_loss (verl's kernel + its ppo_loss):", ""]
        for row in results["shapes"]:
            fused, verl = row.get("fused_loss", {}).get("fwd_bwd_ms"), row.get("verl_loss", {}).get("fwd_bwd_ms")
            if isinstance(fused, float) and isinstance(verl, float):
                lines.append(f"- {row['N']}, {row['H']}, {row['V']}: {verl / fused:.2f}x")
    lines += ["", "Forward without gradient (ratio to one GEMM):", "",
              "| N, H, V | one GEMM | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for row in results["shapes"]:
        gemm = row.get("floor", {}).get("gemm_ms")
        cells = [_fmt(row.get(name, {}).get("fwd_ms"), gemm) for name in names]
        lines.append(f"| {row['N']}, {row['H']}, {row['V']} | {_fmt(gemm)} | " + " | ".join(cells) + " |")
    masked = [m for m in names if any("half_masked_fwd_bwd_ms" in row.get(m, {}) for row in results["shapes"])]
    if masked:
        lines += ["", "Half the rows masked by score_mask, forward+backward (ratio to the unmasked time):", "",
                  "| N, H, V | " + " | ".join(masked) + " |", "|---|" + "---|" * len(masked)]
        for row in results["shapes"]:
            cells = []
            for name in masked:
                r = row.get(name, {})
                full, half = r.get("fwd_bwd_ms"), r.get("half_masked_fwd_bwd_ms")
                cells.append(_fmt(half, full) if isinstance(full, float) else _fmt(half))
            lines.append(f"| {row['N']}, {row['H']}, {row['V']} | " + " | ".join(cells) + " |")
    if results.get("accuracy"):
        n, h, v = results["accuracy_shape"]
        lines += ["", f"Accuracy against fp64 (N={n}, H={h}, V={v}, T={results['temperature']}):", "",
                  "| method | log-prob max err | entropy max err | loss rel err | d_hidden rel err | d_weight rel err |",
                  "|---|---|---|---|---|---|"]
        sci = lambda value: "n/a" if value is None else f"{value:.2e}"  # noqa: E731
        for name, acc in results["accuracy"].items():
            if isinstance(acc, dict):
                lines.append(f"| {name} | {sci(acc['log_prob_max_err'])} | {sci(acc['entropy_max_err'])} | "
                             f"{sci(acc.get('loss_rel_err'))} | {sci(acc['d_hidden_rel_err'])} | {sci(acc['d_weight_rel_err'])} |")
            else:
                lines.append(f"| {name} | {acc} | | | | |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    """Left: forward+backward time over the 4-GEMM floor against N, one line per method and (H, V): a backward
    whose speed depends on N shows as a line leaving 1. Right: extra memory against N."""
    plt = pyplot()
    if plt is None:
        raise SystemExit("bench: the plot needs matplotlib (pip install matplotlib)")
    figure, (ratio_axis, memory_axis) = plt.subplots(1, 2, figsize=(13, 5))
    shapes = results["shapes"]
    names = [m for m in results["methods"] if m != "floor"]
    widths = sorted({(row["H"], row["V"]) for row in shapes})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osd^vP*X"
    for index, name in enumerate(names):
        for w_index, (h, v) in enumerate(widths):
            rows = sorted((r for r in shapes if (r["H"], r["V"]) == (h, v)), key=lambda r: r["N"])
            style = dict(color=colors[index % len(colors)], marker=markers[w_index % len(markers)], label=f"{name} H={h} V={v}")
            ratios = [(r["N"], r[name]["fwd_bwd_ms"] / r["floor"]["fwd_bwd_ms"]) for r in rows
                      if isinstance(r.get(name, {}).get("fwd_bwd_ms"), float) and "floor" in r]
            if ratios:
                ratio_axis.plot(*zip(*ratios), **style)
            memory = [(r["N"], r[name]["extra_gib"]) for r in rows if isinstance(r.get(name, {}).get("extra_gib"), float)]
            if memory:
                memory_axis.plot(*zip(*memory), **style)
    if not memory_axis.lines:
        memory_axis.text(0.5, 0.5, "not measured (--quick)", ha="center", va="center", transform=memory_axis.transAxes)
    ratio_axis.axhline(1.0, color="black", linewidth=0.8)
    ratio_axis.axhline(1.1, color="gray", linewidth=0.8, linestyle="--")
    ratio_axis.set_title("forward+backward time / 4-GEMM cuBLAS floor (dashed: 1.10)")
    memory_axis.set_title("extra memory beyond inputs and returned gradients (GiB)")
    for axis in (ratio_axis, memory_axis):
        axis.set_xlabel("N (tokens)")
        axis.grid(True, which="both", alpha=0.3)
        if axis.lines:
            axis.set_xscale("log", base=2)
            axis.legend(fontsize=7)
    figure.suptitle(f"{results['device']}, bf16, T={results['temperature']}")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
