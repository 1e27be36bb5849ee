"""Command-line arguments several commands take: `--device` and its default, the dtype names, lists of names.

Why one module: ab-parity, bench, e2e-bench, train-parity and doctor each read these; one definition keeps
their defaults, their refusals and the words of those refusals the same in every command.
"""

from __future__ import annotations

import argparse

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default=None, help="default: cuda when a GPU is there, else cpu"
    )


def resolve_device(parser: argparse.ArgumentParser, device: str | None) -> str:
    """`--device` as given, else cuda when a GPU is there, else cpu; cuda without a GPU is refused."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    return device


def default_dtype(device: str) -> str:
    """The model dtype when `--dtype` is not given: bf16 on CUDA, fp32 on the CPU."""
    return "bf16" if device == "cuda" else "fp32"


def known_names(parser: argparse.ArgumentParser, flag: str, text: str, allowed, where: str = "") -> list[str]:
    """The comma-separated names of `text` in their order (empty items skipped); a name not in `allowed` is refused,
    naming `flag` and what it allows (`where`: in which case, e.g. " with --fused-loss")."""
    names = [name for name in text.split(",") if name]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        parser.error(f"{flag}: unknown {unknown}; allowed{where}: {', '.join(allowed)}")
    return names
