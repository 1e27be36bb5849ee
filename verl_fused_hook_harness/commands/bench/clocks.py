"""The SM clock and board power while each method's timed steps run, read from NVML (package nvidia-ml-py).

Why: under these workloads the H200 sits at its 700 W cap and lowers its SM clock to stay there (a median
of 1470 MHz against a 1980 MHz boost in one run). Two methods can then differ in time because one needs
more cycles, or because the card runs it at a lower clock for the same power: a kernel that moves less data
per product draws less power and is clocked higher. The clock during a method's steps tells which, and time
x clock is the cycles it took. Power is NVML's instantaneous reading where the driver gives it, else its 1 s
average, which reads steps of a few hundred ms low (nvml_readings.power_source; the report names which); the
clock is read as it is.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import statistics
import time
from collections.abc import Callable

import torch

from ...support.reports import on_device
from .nvml_readings import AVERAGE, power_source, read_until_stopped
from .timing import event_ms

# Seconds between readings: ~12 per 60 ms step.
SAMPLE_INTERVAL_S = 0.005


class ClockMeter:
    """A spawned process reads the SM clock (MHz) and power (W) every SAMPLE_INTERVAL_S with timestamps
    (nvml_readings.py); the meter files each reading under the step whose time window holds it."""

    def __init__(self, uuid: str, source: str, nvml_module: str = "pynvml", interval_s: float = SAMPLE_INTERVAL_S):
        self.power_source = source  # nvml_readings.INSTANT or AVERAGE, as power_source probed it
        spawn = multiprocessing.get_context("spawn")
        self._conn, child = spawn.Pipe()
        self._process = spawn.Process(
            target=read_until_stopped, args=(nvml_module, uuid, source, interval_s, child), daemon=True
        )
        self._process.start()
        child.close()
        self._windows: dict[str, list[tuple[float, float]]] = {}
        self._readings: list[tuple[float, float, float]] = []
        self._stopped = False

    @classmethod
    def open(cls, device: torch.device | int | None = None) -> tuple[ClockMeter | None, str | None]:
        """(a meter on this CUDA device, None), or (None, why none can be had) when NVML cannot be read."""
        try:
            import pynvml
        except ImportError:
            return None, "pynvml cannot be imported: pip install nvidia-ml-py"
        try:
            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device or torch.cuda.current_device()).uuid)
            uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)
            source = power_source(pynvml, handle)
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as error:  # fails here, not in the reading process
            return None, f"NVML cannot read this GPU ({error})"
        return cls(uuid, source), None

    @contextlib.contextmanager
    def naming(self, name: str):
        """Readings taken while this block runs are `name`'s."""
        start = time.time()
        try:
            yield
        finally:
            self._windows.setdefault(name, []).append((start, time.time()))
            self._fetch()  # outside the window: the reading process's buffer stays short

    def clock(self, name: str | None, step: Callable[[], object]) -> float:
        """A `timing.time_in_rounds` clock: the step's CUDA-event time, its readings filed under `name`
        (the window closes after the closing synchronize, so it covers the GPU's whole run of the step); None
        (a warm-up) files nothing."""
        if name is None:
            return event_ms(step)
        with self.naming(name):
            return event_ms(step)

    def _fetch(self, message: str = "flush") -> None:
        if self._stopped:
            return
        try:
            self._conn.send(message)
            self._readings += self._conn.recv()
        except (BrokenPipeError, ConnectionResetError, EOFError):  # the reading process died (an NVML error)
            self._stopped = True
            self._process.join(timeout=10)
            print(
                f"# SM clock readings stopped: the reading process exited (code {self._process.exitcode}); "
                "later steps have no clock",
                flush=True,
            )

    def take(self, name: str) -> dict:
        """The median SM clock and power of the readings inside `name`'s windows since the last take, and their
        count (then forgets those windows); {} when none fell inside (steps shorter than one interval)."""
        windows = self._windows.pop(name, [])
        inside = [r for r in self._readings if any(start <= r[0] <= end for start, end in windows)]
        still_open = [start for spans in self._windows.values() for start, _ in spans]
        self._readings = [r for r in self._readings if still_open and r[0] >= min(still_open)]
        if not inside:
            return {}
        return {
            "sm_clock_mhz": statistics.median(r[1] for r in inside),
            "power_w": statistics.median(r[2] for r in inside),
            "clock_samples": len(inside),
        }

    def close(self) -> None:
        self._fetch("stop")
        self._stopped = True
        self._process.join(timeout=10)
        self._conn.close()


def megacycles(ms, mhz) -> float | None:
    """Cycles of the SM clock over `ms` milliseconds at `mhz`, in millions; None without both numbers."""
    if not isinstance(ms, float) or not isinstance(mhz, (int, float)):
        return None
    return ms * mhz / 1e3


def clocks_table(results: dict) -> list[str]:
    """Markdown lines: per shape and method, the median SM clock and power during its forward+backward steps and
    the cycles they took (ratio to the floor's cycles). Empty when the run recorded no clocks."""
    names = [m for m in results["methods"] if any("sm_clock_mhz" in row.get(m, {}) for row in results["shapes"])]
    if not names:
        return []
    lines = [
        "",
        f"SM clock and power during forward+backward {on_device(results)} (NVML readings, medians; power "
        f"{results.get('power_reading', AVERAGE)}), and the cycles it took (time x clock; ratio to the floor's "
        "cycles):",
        "",
        "| N, H, V | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for row in results["shapes"]:
        floor = row.get("floor", {})
        floor_cycles = megacycles(floor.get("fwd_bwd_ms"), floor.get("sm_clock_mhz"))
        cells = []
        for name in names:
            r = row.get(name, {})
            cycles = megacycles(r.get("fwd_bwd_ms"), r.get("sm_clock_mhz"))
            if cycles is None:
                cells.append("n/a")
                continue
            ratio = f" ({cycles / floor_cycles:.2f}x)" if floor_cycles else ""
            cells.append(f"{r['sm_clock_mhz']:.0f} MHz, {r['power_w']:.0f} W, {cycles:,.0f} Mcycles{ratio}")
        lines.append(f"| {row['N']}, {row['H']}, {row['V']} | " + " | ".join(cells) + " |")
    return lines
