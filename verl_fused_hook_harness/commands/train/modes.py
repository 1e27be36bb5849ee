"""The fused-forward modes train-parity runs, and which run each mode is compared with.

Why a module of its own: the runner (which engines a mode builds) and the
report (which identities and gaps a mode is judged by) must agree on one table,
and a merged report, read back from JSON, has only the mode names to go by.
"""

from __future__ import annotations

from ...support.modes import Mode

LEGACY = "legacy"
# The hook's backend per kernel: verl's kernel, or "auto" (this package's kernel for the device).
BACKENDS = {"verl": "verl", "ours": "auto"}

MODES = {
    m.name: m
    for m in (
        Mode(LEGACY, hook=False, kernel="verl"),
        Mode("hook-verl", hook=True, kernel="verl", cuda_only=True),
        Mode("hook-auto", hook=True, kernel="ours"),
        Mode("hook-auto-mask", hook=True, kernel="ours", score_mask=True),
        Mode("hook-auto-fused-loss", hook=True, kernel="ours", fused_loss=True, twin="hook-auto"),
    )
}


def one_kernel_mode(device: str) -> str:
    """The hook mode that computes with legacy's kernel: verl's Triton on CUDA, the portable op on the CPU."""
    return "hook-verl" if device == "cuda" else "hook-auto"


def fused_kernel_options(mode: Mode, *, batch_invariant: bool = False) -> dict:
    """The engine's `fused_kernel_options` for a mode (the environment switch picks hook or legacy); with
    `batch_invariant` (megatron's batch_invariant_mode) the op's own batch invariance too."""
    if not mode.hook:
        return {}
    options = {"output_processor_backend": BACKENDS[mode.kernel]}
    if batch_invariant:
        options["output_processor_batch_invariant"] = True
    if mode.fused_loss:
        options["output_processor_fused_loss"] = True
    if not mode.score_mask:
        options["output_processor_score_mask"] = False
    return options


def ordered_modes(names) -> list[str]:
    """The given mode names in the table's order (a report lists its runs the same way however they were made)."""
    unknown = sorted(set(names) - set(MODES))
    if unknown:
        raise ValueError(f"train-parity report: unknown modes {unknown}; allowed: {', '.join(MODES)}")
    return [name for name in MODES if name in set(names)]
