"""The SM clock and board power while each method's timed steps run, read from NVML (package nvidia-ml-py).

Why: under these workloads the H200 sits at its 700 W cap and lowers its SM clock to stay there (a median
of 1470 MHz against a 1980 MHz boost in one run). Two methods can then differ in time because one needs
more cycles, or because the card runs it at a lower clock for the same power: a kernel that moves less data
per product draws less power and is clocked higher. The clock during a method's steps tells which, and time
x clock is the cycles it took.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
from typing import Callable

import torch

from .bench_timing import event_ms

# Seconds between readings: ~12 per 60 ms step, each reading a few tens of microseconds of a host thread.
SAMPLE_INTERVAL_S = 0.005


class ClockMeter:
    """Reads the SM clock (MHz) and power (W) every SAMPLE_INTERVAL_S on a thread and files each reading under
    the step running at that moment (`naming`). `nvml` is the pynvml module, `handle` the GPU's NVML handle."""

    def __init__(self, nvml, handle, interval_s: float = SAMPLE_INTERVAL_S):
        self._nvml, self._handle, self._interval = nvml, handle, interval_s
        self._current: str | None = None
        self._samples: dict[str, list[tuple[float, float]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-clock-meter", daemon=True)
        self._thread.start()

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
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)  # fails here, not on the thread
        except pynvml.NVMLError as error:
            return None, f"NVML cannot read this GPU ({error})"
        return cls(pynvml, handle), None

    def _sample(self) -> None:
        nvml, handle = self._nvml, self._handle
        while not self._stop.wait(self._interval):
            name = self._current
            if name is None:
                continue
            clock = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)
            power = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # milliwatts
            if self._current == name:  # still the same step: a reading taken across a switch is dropped
                self._samples.setdefault(name, []).append((float(clock), power))

    @contextlib.contextmanager
    def naming(self, name: str):
        """Readings taken inside this block are `name`'s."""
        self._current = name
        try:
            yield
        finally:
            self._current = None

    def clock(self, name: str, step: Callable[[], object]) -> float:
        """A `bench_timing.time_in_rounds` clock: the step's CUDA-event time, its readings filed under `name`
        (the block ends after the closing synchronize, so the readings cover the GPU's whole run of it)."""
        with self.naming(name):
            return event_ms(step)

    def take(self, name: str) -> dict:
        """The median SM clock and power of `name`'s readings since the last take, and their count (then forgets
        them); {} when none was taken (a step shorter than one interval)."""
        samples = self._samples.pop(name, [])
        if not samples:
            return {}
        return {"sm_clock_mhz": statistics.median(s[0] for s in samples),
                "power_w": statistics.median(s[1] for s in samples), "clock_samples": len(samples)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


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
    lines = ["", "SM clock and power during forward+backward (NVML readings, medians), and the cycles it took "
             "(time x clock; ratio to the floor's cycles):", "",
             "| N, H, V | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
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
