"""Liger-Kernel's Hopper kernels as bench methods: `liger_sm90` and `liger_tp_native`.

Why apart from methods.py's `liger` (its fused linear cross-entropy, the loss only): Liger >= 0.8.5 also
returns per-token NLL and entropy at a temperature, the problem this package solves, through two kernels that
run only on Hopper-class GPUs and only with packages pip does not pull in:

- `liger_sm90`: `LigerFusedLinearScaledCrossEntropyFunction`, which on sm90 dispatches to a CuTe-DSL kernel
  (needs `nvidia-cutlass-dsl`; without it the dispatch's import fails).
- `liger_tp_native`: `LigerFusedLinearScaledCrossEntropyTPFunction` on its native CUTLASS + NVSHMEM path (needs
  the `liger-cute-kernels` wheel), here at TP=1 over a one-rank NCCL group. Its frontend silently takes a
  chunked torch fallback when the native path is missing; this method refuses to run in that case instead,
  so a row labelled liger_tp_native is always the native kernel. Its kernel refuses 32768 tokens or more per
  call on one H200, so larger N runs as consecutive calls of at most TP_NATIVE_MAX_TOKENS rows (what a user of
  it would have to do; d_weight sums over the calls through autograd).

Each loader returns the method, or the reason it cannot run here (bench prints it and skips the method).
Both methods get the raw hidden states and the temperature, like ours, and return (log-probs, entropy).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
import torch.distributed as dist

IGNORE_INDEX = -100
# Liger's native kernel at TP=1 on one H200: 16384 tokens per call run, 32768 fail its
# `split.num_cluster_pairs <= max_active_cluster_pairs` check.
TP_NATIVE_MAX_TOKENS = 16384


def _hopper_reason(allow_blackwell: bool = False) -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) == (9, 0) or (allow_blackwell and major == 10):
        return None
    return f"needs an sm90 GPU{' or sm100' if allow_blackwell else ''}, got sm{major}{minor}"


def _frontend(module: str, *names: str) -> tuple | str:
    """`names` from liger_kernel's `module`, or why they cannot be had (liger-kernel absent, or older than 0.8.5)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed"
    try:
        loaded = importlib.import_module(module)
        return tuple(getattr(loaded, name) for name in names)
    except (ImportError, AttributeError) as error:
        return f"needs liger-kernel >= 0.8.5 ({error})"


FRONTEND = "liger_kernel.ops.fused_linear_scaled_cross_entropy"


def liger_sm90() -> Callable | str:
    frontend = _frontend(FRONTEND, "LigerFusedLinearScaledCrossEntropyFunction")
    if isinstance(frontend, str):
        return frontend
    (scaled_cross_entropy,) = frontend
    reason = _hopper_reason()
    if reason is not None:
        return reason
    try:  # what the frontend's sm90 dispatch imports
        from liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90 import (  # noqa: F401
            LigerFusedScaledCrossEntropySM90Function,
        )
    except ImportError as error:
        return f"its sm90 kernel cannot be imported ({error}): pip install nvidia-cutlass-dsl"

    def fn(h, w, labels, temperature, score_mask=None):
        nll, entropy = scaled_cross_entropy.apply(h, w, labels, float(temperature), IGNORE_INDEX, 1, True)
        return -nll, entropy

    return fn


def liger_tp_native(shapes: list[tuple[int, int, int]]) -> Callable | str:
    """The native kernel at TP=1 over a one-rank NCCL group; its runtime (NVSHMEM and the kernel's workspace) is
    configured once, through Liger's own `configure`, for the largest N, H and V among `shapes`."""
    frontend = _frontend(FRONTEND, "LigerFusedLinearScaledCrossEntropyTPFunction")
    native = _frontend("liger_kernel.ops.cute.fused_linear_scaled_cross_entropy_tp", "is_available")
    setup = _frontend("liger_kernel.ops.configure", "configure", "FusedLinearCrossEntropyConfig")
    for found in (frontend, native, setup):
        if isinstance(found, str):
            return found
    (scaled_cross_entropy_tp,), (is_available,), (configure, FlsceConfig) = frontend, native, setup
    reason = _hopper_reason(allow_blackwell=True)
    if reason is not None:
        return reason
    if not is_available():
        return (
            "its native CUTLASS + NVSHMEM kernel is not available (the liger-cute-kernels wheel and NVSHMEM); "
            "the frontend would run its chunked torch fallback instead"
        )
    if not shapes:
        return "no shapes to reserve its workspace for"
    if not dist.is_initialized():
        from ...support.distributed import init_one_rank_group

        init_one_rank_group("nccl")
    group = dist.group.WORLD
    most_rows = max(n for n, _, _ in shapes)
    if most_rows > TP_NATIVE_MAX_TOKENS:
        print(
            f"# liger_tp_native: N above {TP_NATIVE_MAX_TOKENS} runs as calls of at most {TP_NATIVE_MAX_TOKENS} "
            "rows (its kernel refuses 32768 or more per call on one H200)",
            flush=True,
        )
    largest = FlsceConfig(
        max_tokens=min(most_rows, TP_NATIVE_MAX_TOKENS),
        hidden_size=max(h for _, h, _ in shapes),
        local_vocab_size=max(v for _, _, v in shapes),
        group="tp",
    )
    if not configure(process_groups={"tp": group}, bootstrap_group=group, flsce=largest):
        return "Liger's configure refused this device (see its warning)"

    def one_call(h, w, labels, temperature):
        nll, entropy = scaled_cross_entropy_tp.apply(h, w, labels, group, float(temperature), IGNORE_INDEX, 1, True)
        return -nll, entropy

    return in_calls_of_at_most(TP_NATIVE_MAX_TOKENS, one_call)


def in_calls_of_at_most(max_rows: int, one_call: Callable) -> Callable:
    """A bench method running `one_call(h, w, labels, temperature) -> (log-probs, entropy)` on consecutive slices of
    at most `max_rows` rows and concatenating the results; autograd sums the calls' d_weight."""

    def fn(h, w, labels, temperature, score_mask=None):
        pieces = [
            one_call(h[start : start + max_rows], w, labels[start : start + max_rows], temperature)
            for start in range(0, h.shape[0], max_rows)
        ]
        if len(pieces) == 1:
            return pieces[0]
        return torch.cat([log_probs for log_probs, _ in pieces]), torch.cat([entropy for _, entropy in pieces])

    return fn
