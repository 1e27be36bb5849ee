"""A stand-in for pynvml's calls that bench's clock meter makes, for this machine, which has no NVIDIA driver.

It runs in the meter's spawned reading process, so the test programs it through a file named by the
environment variable NVML_STAND_IN_FILE: "clock_mhz,average_power_mw[,instant_power_mw]", rewritten whenever the
test wants new readings; without the third value the instantaneous power field answers "not supported", as on a
driver or GPU without it."""

import os
from types import SimpleNamespace

NVML_CLOCK_SM = 1
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_FI_DEV_POWER_INSTANT = 186


class NVMLError(Exception):
    pass


def _reading() -> list[int]:
    with open(os.environ["NVML_STAND_IN_FILE"]) as f:
        values = [int(x) for x in f.read().split(",")]
    if len(values) not in (2, 3):
        raise ValueError(f"the stand-in's file holds {len(values)} values")
    return values


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


def nvmlDeviceGetFieldValues(handle, field_ids):
    """One value per field, as pynvml's array of c_nvmlFieldValue_t is read (nvmlReturn, valueType, value.uiVal)."""
    reading = _reading()
    out = []
    for field in field_ids:
        known = field == NVML_FI_DEV_POWER_INSTANT and len(reading) == 3
        out.append(
            SimpleNamespace(
                fieldId=field,
                nvmlReturn=NVML_SUCCESS if known else NVML_ERROR_NOT_SUPPORTED,
                valueType=NVML_VALUE_TYPE_UNSIGNED_INT,
                value=SimpleNamespace(uiVal=reading[2] if known else 0),
            )
        )
    return out
