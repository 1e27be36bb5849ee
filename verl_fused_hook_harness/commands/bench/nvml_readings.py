"""A process that reads the GPU's SM clock and power from NVML every few milliseconds, with timestamps.

Power is the instantaneous reading (NVML's field NVML_FI_DEV_POWER_INSTANT) where the driver has it:
`nvmlDeviceGetPowerUsage` returns an average over the last second on Ampere and newer (GA100 aside), which reads
a step of 100-200 ms low whenever what ran before it drew less (the H100's kl_topk steps at 16384 tokens read
244-351 W beside the floor's 693 W that way). Without the field the average is read, and the report says so.

Why a process and not a thread: a thread of the benchmark's own interpreter can read only when the main
thread lets go of the GIL, so when it reads would depend on what the steps do on the host; a process keeps its
own schedule. (On the H200, warm-ups left out, a thread reader and this process both read power far below the
cap during 8192-token steps, 402 W and 381 W for ours, so that was not the GIL's doing: this is a guard, not
a measured correction.) This module imports nothing heavy, so the
spawned process starts in a moment.
"""

from __future__ import annotations

import importlib
import time

# Readings kept while the parent asks for none (~2 minutes at 5 ms); past that the oldest are dropped.
MAX_KEPT = 25_600

INSTANT = "instant"
AVERAGE = "1 s average"


def power_source(nvml, handle) -> str:
    """INSTANT when this driver and GPU answer the instantaneous power field, else AVERAGE (probed once, by the
    meter, before the reading process starts: the process reads the source the results record)."""
    if getattr(nvml, "NVML_FI_DEV_POWER_INSTANT", None) is None:
        return AVERAGE
    try:
        read_power(nvml, handle, INSTANT)
    except nvml.NVMLError:
        return AVERAGE
    return INSTANT


def read_power(nvml, handle, source: str) -> float:
    """The board power in W from `source` (an NVMLError if the instantaneous field does not answer)."""
    if source == AVERAGE:
        return nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0  # milliwatts
    value = nvml.nvmlDeviceGetFieldValues(handle, [nvml.NVML_FI_DEV_POWER_INSTANT])[0]
    if value.nvmlReturn != nvml.NVML_SUCCESS:
        raise nvml.NVMLError(value.nvmlReturn)
    if value.valueType != nvml.NVML_VALUE_TYPE_UNSIGNED_INT:  # milliwatts as an unsigned int, or unusable
        raise nvml.NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)
    return value.value.uiVal / 1000.0


def read_until_stopped(nvml_module: str, uuid: str, source: str, interval_s: float, conn) -> None:
    """Run in the spawned process: (time.time(), SM clock MHz, power W from `source`) every `interval_s`; on
    "flush" from the parent, send what was read since the last send; on "stop", send it and return.
    `nvml_module`: "pynvml", or a stand-in with the same calls where the machine has no NVIDIA driver (tests)."""
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
            readings.append((time.time(), float(clock), read_power(nvml, handle, source)))
            if len(readings) > MAX_KEPT:
                del readings[0]
    finally:
        nvml.nvmlShutdown()
