"""How the commands write what they found: JSON (to a file or stdout), markdown tables beside it, plots,
and the units in their tables. One writer, so every command's files look alike and land where its --out says.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def write_json(report: dict, path: str | Path, *, indent: int = 2) -> None:
    """The report as JSON in `path`, or on stdout for "-"."""
    text = json.dumps(report, indent=indent, default=str)
    if str(path) == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")


def write_report(report: dict, out: Path | None, stem: str, table: Callable[[dict], str]) -> None:
    """out/STEM.json and out/STEM.md (the report through `table`); nothing when `out` is None."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json(report, out / f"{stem}.json")
    (out / f"{stem}.md").write_text(table(report) + "\n")


def device_name(device: str) -> str:
    """The report's device field: the GPU's name, or "cpu"."""
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu"


def on_device(report: dict) -> str:
    """'on CARD' for a table's title: a ratio read on one card does not hold on another (issue 55: the forward over
    one GEMM was 1.04-1.09x on an H200, 1.18-1.51x on an H100)."""
    return f"on {report.get('device') or 'an unrecorded device'}"


def pyplot():
    """matplotlib.pyplot drawing to files (the Agg backend); None when matplotlib is not installed."""
    try:
        import matplotlib  # optional: only the plots need it
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
