"""Argument checks written once: a count (an int, never a bool, within bounds), a flag, a number.

Why: Python's bool is an int, so `isinstance(value, int)` lets True through as 1; every field that takes a count
needs the same two-sided test, and every refusal the same shape of message: the field, what it takes, the value
given. Imports nothing of the package, so the op (ops/) may use it too.
"""

from __future__ import annotations


def is_number(value) -> bool:
    """An int or a float, never a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(
    field: str,
    value,
    *,
    low: int | None = None,
    high: int | None = None,
    optional: bool = False,
    expected: str | None = None,
) -> None:
    """ValueError "{field}: {expected}, got {value!r}" unless `value` is an int (never a bool) in [low, high], or
    None when `optional`. `expected` defaults to "expected an int", "expected an int >= {low}" or "expected None or
    an int >= {low}"."""
    if value is None and optional:
        return
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (low is None or value >= low)
        and (high is None or value <= high)
    ):
        return
    if expected is None:
        bound = "" if low is None else f" >= {low}"
        expected = f"expected None or an int{bound}" if optional else f"expected an int{bound}"
    raise ValueError(f"{field}: {expected}, got {value!r}")


def check_bool(field: str, value) -> None:
    """ValueError "{field}: expected a bool, got {value!r}" unless `value` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"{field}: expected a bool, got {value!r}")
