"""TEST-ONLY stand-in for `ray` on the GPU device machine (see ../README.md).

Defines only the names verl 0.9.1 touches while being imported; every call that
would need a real ray cluster raises RuntimeError. Never used by the product.
"""

from __future__ import annotations

STANDIN = True


def _unavailable(what: str):
    raise RuntimeError(
        f"ray.{what}: this is the test-only ray stand-in from scripts/device_stubs (no ray on this machine); "
        "install the real ray to use verl's distributed driver"
    )


class ObjectRef:
    """Type placeholder (verl uses `ray.ObjectRef` in annotations and isinstance checks)."""


class ActorHandle:
    """Type placeholder."""


def is_initialized() -> bool:
    return False


def init(*args, **kwargs):
    _unavailable("init")


def get(*args, **kwargs):
    _unavailable("get")


def put(*args, **kwargs):
    _unavailable("put")


def remote(*args, **kwargs):
    _unavailable("remote")
