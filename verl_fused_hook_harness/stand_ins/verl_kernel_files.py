"""verl's Triton `linear_cross_entropy`, loaded from its source files without `import verl` (the op benchmark).

STAND-IN, named as such: `import verl` starts ray, which the kernel benchmark
does not need; verl's kernel files import only `verl.utils.device` from verl.
While they load, that module is a stand-in answering for CUDA (the benchmark
runs on CUDA only), and the files become a package of their own
(`_bench_verl_kernel`); `sys.modules` is restored afterwards.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch

PACKAGE = "_bench_verl_kernel"


def _device_module() -> types.ModuleType:
    device = types.ModuleType("verl.utils.device")
    device.get_device_capability = torch.cuda.get_device_capability
    device.get_device_name = lambda: "cuda"
    device.is_cuda_available = torch.cuda.is_available()
    device.get_torch_device = lambda: torch.cuda
    return device


def installed_kernel_dir() -> Path | None:
    """verl's kernel folder in the installed package (found without running verl), or None."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent / "utils" / "kernel"


def load_verl_linear_cross_entropy(kernel_dir: str | Path | None = None):
    """verl's `linear_cross_entropy` from `kernel_dir` (default: the installed verl's); None when absent."""
    folder = Path(kernel_dir) if kernel_dir is not None else installed_kernel_dir()
    if folder is None or not (folder / "kernels.py").exists():
        return None
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(folder)]
    saved = sys.modules.get("verl.utils.device")
    sys.modules["verl.utils.device"] = _device_module()
    sys.modules[PACKAGE] = package
    try:
        for name in ("kernels", "linear_cross_entropy"):
            spec = importlib.util.spec_from_file_location(f"{PACKAGE}.{name}", folder / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
    finally:
        if saved is None:
            del sys.modules["verl.utils.device"]
        else:
            sys.modules["verl.utils.device"] = saved
    return sys.modules[f"{PACKAGE}.linear_cross_entropy"].linear_cross_entropy
