"""Bitwise-repeatable forward+backward on CUDA, for parity runs (A/B script, end-to-end bench).

Why: verl's kernel (its default split-vocabulary backward) and this package's
kernels are deterministic, but by default two identical forward+backward passes
of a GPTModel on CUDA still differ in the gradients: SDPA's flash and
memory-efficient attention backwards accumulate with atomic adds, and
megatron's vocab-parallel embedding backward goes through `F.embedding`
(megatron's own `deterministic_mode` avoids it). Transformer Engine's attention
(the TE layer spec) fixes its `deterministic` field when it is built (from
NVTE_ALLOW_NONDETERMINISTIC_ALGO or PyTorch's flag at that moment) and reads it
at every forward to pick its backend; `te_attention=True` switches it too. Only
for small packed batches: on sm90 TE 2.20.2 turns its deterministic fused THD
backward off from batch x heads x max_seqlen^2 >= 2^30 (cuDNN's workspace; the
7B shapes reach it at 16k tokens) and falls back to an unfused attention that
holds every [b, h, s, s] score. A parity claim of max_abs = 0 needs every op
deterministic, so parity steps run inside `deterministic_steps`. It slows those
steps; timed steps run outside it.
"""

from __future__ import annotations

import contextlib
import os

import torch

CUBLAS_WORKSPACE_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_WORKSPACE_SETTING = ":4096:8"


def prepare_cublas_workspace() -> None:
    """Set the cuBLAS workspace that deterministic mode requires; call before CUDA's first GEMM.

    PyTorch refuses cuBLAS calls in deterministic mode without it; a value the user set is kept."""
    if not os.environ.get(CUBLAS_WORKSPACE_VARIABLE):
        os.environ[CUBLAS_WORKSPACE_VARIABLE] = CUBLAS_WORKSPACE_SETTING


# Module fields read at each step: megatron's embedding's; Transformer Engine's attention's and its backends'
MEGATRON_FIELD, TE_ATTENTION_FIELD = "deterministic_mode", "deterministic"


@contextlib.contextmanager
def deterministic_steps(*models: torch.nn.Module, te_attention: bool = False):
    """Within the block: PyTorch's deterministic algorithms (attention takes its deterministic backward)
    and megatron's `deterministic_mode` on every module of `models` that reads it; with `te_attention`
    Transformer Engine's attention's `deterministic` too (small packed batches only, see above). Restored on exit."""
    if not os.environ.get(CUBLAS_WORKSPACE_VARIABLE):
        raise RuntimeError(
            f"{CUBLAS_WORKSPACE_VARIABLE} is unset: call prepare_cublas_workspace() before CUDA is first used"
        )
    fields = (MEGATRON_FIELD, TE_ATTENTION_FIELD) if te_attention else (MEGATRON_FIELD,)
    switched = [
        (m, field) for model in models for m in model.modules() for field in fields if getattr(m, field, None) is False
    ]
    previous = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)  # warn_only=False: attention backwards are deterministic only then
    for module, field in switched:
        setattr(module, field, True)
    try:
        yield
    finally:
        for module, field in switched:
            setattr(module, field, False)
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
