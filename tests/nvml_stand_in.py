"""A stand-in for pynvml's calls that bench's clock meter makes, for this machine, which has no NVIDIA driver.

It runs in the meter's spawned reading process, so the test programs it through a file named by the
environment variable NVML_STAND_IN_FILE: "clock_mhz,power_mw", rewritten whenever the test wants new readings."""

import os

NVML_CLOCK_SM = 1


class NVMLError(Exception):
    pass


def _reading() -> tuple[int, int]:
    with open(os.environ["NVML_STAND_IN_FILE"]) as f:
        clock, power = f.read().split(",")
    return int(clock), int(power)


def nvmlInit():
    pass


def nvmlShutdown():
    pass


def nvmlDeviceGetHandleByUUID(uuid):
    if not uuid.startswith("GPU-"):
        raise NVMLError(f"not a GPU UUID: {uuid}")
    return uuid


def nvmlDeviceGetClockInfo(handle, which):
    assert which == NVML_CLOCK_SM
    return _reading()[0]


def nvmlDeviceGetPowerUsage(handle):
    return _reading()[1]
