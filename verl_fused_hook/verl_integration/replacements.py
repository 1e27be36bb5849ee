"""The record of verl attributes the plugin replaced, so that each is replaced once and `restore()` undoes all.

Why its own module: the call sites (which import megatron-core) and the Ray
runtime-env forwarding (which must not) share one record.
"""

from __future__ import annotations

_originals: dict[tuple[object, str], object] = {}


def replace(owner, name: str, make) -> None:
    """Set `owner.name` to `make(original)` and remember the original; nothing changes if `make` raises,
    so a later call retries instead of finding the attribute already recorded."""
    if (owner, name) in _originals:
        return
    original_value = getattr(owner, name)
    replacement = make(original_value)
    setattr(owner, name, replacement)
    _originals[(owner, name)] = original_value


def original(owner, name: str):
    """verl's own object behind a replaced attribute (the attribute itself when not replaced)."""
    return _originals.get((owner, name), getattr(owner, name))


def restore() -> None:
    """Put every replaced attribute back (tests, and switching a process back to plain verl)."""
    for (owner, name), value in list(_originals.items()):
        setattr(owner, name, value)
        del _originals[(owner, name)]
