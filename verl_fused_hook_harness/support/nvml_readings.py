"""A process that reads the GPU's SM clock and power from NVML every few milliseconds, with timestamps.

Why a process and not a thread: a thread of the benchmark's own interpreter reads only when the main thread
lets go of the GIL, which happens mostly in the gaps between steps, so its readings lean toward an idle GPU (a
thread gave a 402 W median during steps that ran at the 690 W cap). This module imports nothing heavy, so
the spawned process starts in a moment.
"""

from __future__ import annotations

import importlib
import time

# Readings sent to the parent at once, at most (it asks for them with "flush").
BATCH = 256


def read_until_stopped(nvml_module: str, uuid: str, interval_s: float, conn) -> None:
    """Run in the spawned process: (time.time(), SM clock MHz, power W) every `interval_s`; on "flush" from the
    parent, send what was read since the last send; on "stop", send it and return. `nvml_module`: "pynvml", or
    a stand-in with the same calls where the machine has no NVIDIA driver (tests)."""
    nvml = importlib.import_module(nvml_module)
    nvml.nvmlInit()
    handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
    readings = []
    try:
        while True:
            if conn.poll(interval_s):
                message = conn.recv()
                conn.send(readings)
                readings = []
                if message == "stop":
                    return
                continue
            clock = nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM)
            power = nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # milliwatts
            readings.append((time.time(), float(clock), power))
            if len(readings) > 100 * BATCH:  # nobody asked for a long while: keep the newest
                del readings[:BATCH]
    finally:
        nvml.nvmlShutdown()
