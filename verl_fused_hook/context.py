"""The per-forward options of `fused_output_processor`, passed as `GPTModel.forward(output_processor_context=...)`.

Why a frozen dataclass checked on construction: the processor itself is
stateless, so everything a forward needs (temperature, rows to score, the op
backend, a loss to compute inside the op) travels here, and a bad field is
named when the context is built, before the model runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .checks import check_bool, check_int
from .ops import BACKEND_CHOICES, backend_capabilities, check_temperature_values


@dataclass(frozen=True)
class SamplingReplay:
    """What `fused_output_processor` replays (the op `replayed_log_probs`): the rollout's kept sets, or its truncation
    to compute them from the trainer's own logits.

    kept_ids: integer [b, s, k] like labels plus a last dim, each row's kept ids (-1 padding, the label among them on
        every scored row), or None: computed with vLLM's rule from top_k / top_p.
    top_k: -1 (off) or >= 1; top_p: in (0, 1] (1: off); max_kept: the widest kept set (>= top_k)."""

    kept_ids: torch.Tensor | None = field(default=None, repr=False)
    top_k: int = -1
    top_p: float = 1.0
    max_kept: int = 512


def _check_temperature_field(temperature) -> None:
    if isinstance(temperature, torch.Tensor) and (not temperature.is_floating_point() or temperature.dim() > 2):
        raise ValueError(
            "FusedOutputProcessorContext.temperature: a tensor must be floating point and 0-d, [b] or [b, s], "
            f"got {temperature.dtype} {tuple(temperature.shape)}"
        )
    check_temperature_values("FusedOutputProcessorContext.temperature", temperature)


@dataclass(frozen=True)
class FusedOutputProcessorContext:
    """Per-forward options of `fused_output_processor` (passed as `output_processor_context=`).

    temperature: float > 0, or a tensor: 0-d, per sample [b], or per token [b, s].
    calculate_entropy: compute the entropy too (False returns entropy None).
    score_mask: bool [b, s]; False positions are never multiplied by the output
        weight (prompt, padding) and get log-prob 0, entropy 0. A mask on the host stays there:
        the op finds its rows without waiting for the GPU.
    backend: the op backend (`verl_fused_hook.ops.BACKEND_CHOICES`): "auto", "torch", GPU
        kernels, or "verl" for verl's own Triton kernel (scalar temperature, every row and column).
    tile_rows: rows per tile (None: the op's default).
    vocab_size: the true vocabulary; padded columns past it leave the softmax.
    as_tuple: return `(log_probs, entropy)` tensors instead of an output object
        (the combined-1F1B schedule plan only carries tensors).
    loss_fn: a token-separable loss of the [s, b] log-probs and entropy -> (loss, metrics),
        computed inside the op (`log_probs_entropy_and_loss`); the output's `loss` then
        back-propagates into the model and `loss_metrics` holds the metrics.
    loss_name: names loss_fn in errors.
    row_gradients: optional per-row gradients of loss_fn (see `log_probs_entropy_and_loss`).
    host_loss_fn: optional, loss_fn over host tensors, for the final evaluation (see
        `log_probs_entropy_and_loss`).
    loss_chunk_bytes: the fused loss's chunk of stored logits in bytes (None: the op's default;
        tile_rows, when given, wins).
    loss_row_groups: int64 [b, s] like labels, for a loss whose row gradients depend on their
        sequence (GSPO): each position's sequence id (-1: none); the op keeps each sequence's
        rows in one chunk (`log_probs_entropy_and_loss(row_groups=...)`).
    keep_logits_bytes: without loss_fn, memory the op may hold from forward to backward to keep
        scored rows' logits instead of recomputing them (`log_probs_and_entropy(keep_logits_bytes=...)`;
        0: recompute every row).
    token_ids: integer [b, s, k] like labels plus a last dim: also return each id's log-prob
        (`token_log_probs`, differentiable), e.g. a teacher's top-k for distillation.
    top_k: also return the row's own top_k ids and log-probs (`top_ids`, `top_log_probs`; no gradient).
    calculate_sum_pi_squared: also return sum_j p_j^2 per row (`sum_pi_squared`; no gradient).
    calculate_log_probs: False returns `log_probs=None` (labels still say which rows are computed).
    The last four run the op `token_log_probs` (two passes); not with loss_fn, keep_logits_bytes or as_tuple.
    batch_invariant: every forward value of a row the same bits whatever batch computes it, or an error from a
        backend that cannot promise it (the ops' `batch_invariant`, docs/op.md; the Triton and verl backends'
        log-probs and entropy are invariant without it).
    replay: a SamplingReplay: log-probs and entropy renormalized over each row's kept set (sampling replay, the op
        `replayed_log_probs`); the output also carries `kept_ids` [b, s, k] and, when computed, `kept_mass` [b, s].
        With token_ids only (no loss_fn, keep_logits_bytes, as_tuple, top_k, calculate_sum_pi_squared).
    """

    temperature: float | torch.Tensor = 1.0
    calculate_entropy: bool = True
    score_mask: torch.Tensor | None = field(default=None, repr=False)
    backend: str = "auto"
    tile_rows: int | None = None
    vocab_size: int | None = None
    as_tuple: bool = False
    loss_fn: Callable[..., tuple[torch.Tensor, Any]] | None = field(default=None, repr=False)
    loss_name: str = "loss"
    row_gradients: Callable | None = field(default=None, repr=False)
    host_loss_fn: Callable[..., tuple[torch.Tensor, Any]] | None = field(default=None, repr=False)
    loss_chunk_bytes: int | None = None
    loss_row_groups: torch.Tensor | None = field(default=None, repr=False)
    keep_logits_bytes: int = 0
    token_ids: torch.Tensor | None = field(default=None, repr=False)
    top_k: int = 0
    calculate_sum_pi_squared: bool = False
    calculate_log_probs: bool = True
    batch_invariant: bool = False
    replay: SamplingReplay | None = None

    @property
    def asks_token_outputs(self) -> bool:
        """Whether the processor runs `token_log_probs` (ids' log-probs, top-k, sum pi^2 or no label log-prob)."""
        asked = (self.token_ids is not None, self.top_k > 0, self.calculate_sum_pi_squared)
        return any(asked) or not self.calculate_log_probs

    def __post_init__(self):
        for name in ("row_gradients", "host_loss_fn", "loss_chunk_bytes", "loss_row_groups"):
            if getattr(self, name) is not None and self.loss_fn is None:
                raise ValueError(f"FusedOutputProcessorContext.{name}: belongs to a fused loss; set loss_fn too")
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(
                f"FusedOutputProcessorContext.backend: unknown {self.backend!r}; allowed: {', '.join(BACKEND_CHOICES)}"
            )
        capabilities = backend_capabilities(self.backend)
        if self.loss_fn is not None and (not capabilities.loss_inside or self.as_tuple):
            raise ValueError(
                "FusedOutputProcessorContext.loss_fn: needs a backend that runs the loss inside the op ("
                f"{', '.join(n for n in BACKEND_CHOICES if backend_capabilities(n).loss_inside)}) and an output "
                "object (as_tuple=False)"
            )
        _check_temperature_field(self.temperature)
        check_bool("FusedOutputProcessorContext.calculate_entropy", self.calculate_entropy)
        check_bool("FusedOutputProcessorContext.as_tuple", self.as_tuple)
        check_bool("FusedOutputProcessorContext.batch_invariant", self.batch_invariant)
        if self.score_mask is not None and (
            not isinstance(self.score_mask, torch.Tensor)
            or self.score_mask.dtype != torch.bool
            or self.score_mask.dim() != 2
            or self.score_mask.device.type == "meta"
        ):
            raise ValueError(
                "FusedOutputProcessorContext.score_mask: expected None or a bool tensor [b, s] shaped like labels "
                "(not on the meta device)"
            )
        check_int("FusedOutputProcessorContext.tile_rows", self.tile_rows, low=1, optional=True)
        check_int("FusedOutputProcessorContext.loss_chunk_bytes", self.loss_chunk_bytes, low=1, optional=True)
        check_int("FusedOutputProcessorContext.keep_logits_bytes", self.keep_logits_bytes, low=0)
        if self.keep_logits_bytes and self.loss_fn is not None:
            raise ValueError(
                "FusedOutputProcessorContext.keep_logits_bytes: belongs to the op without a fused loss (whose chunks "
                "of "
                "kept logits loss_chunk_bytes sizes); set one or the other"
            )
        if self.loss_row_groups is not None and (
            not isinstance(self.loss_row_groups, torch.Tensor)
            or self.loss_row_groups.dtype != torch.int64
            or self.loss_row_groups.dim() != 2
        ):
            raise ValueError(
                "FusedOutputProcessorContext.loss_row_groups: expected None or an int64 tensor [b, s] shaped like "
                "labels"
            )
        check_int("FusedOutputProcessorContext.vocab_size", self.vocab_size, low=1, optional=True)
        self._check_token_fields(capabilities)
        self._check_replay(capabilities)
        unsupported = [
            name
            for name, used in (
                ("score_mask", self.score_mask is not None and not capabilities.row_selection),
                ("vocab_size", self.vocab_size is not None and not capabilities.padded_vocabulary),
                (
                    "temperature",
                    isinstance(self.temperature, torch.Tensor)
                    and self.temperature.dim() > 0
                    and not capabilities.per_row_temperature,
                ),
            )
            if used
        ]
        if unsupported:
            raise ValueError(
                f"FusedOutputProcessorContext.{unsupported[0]}: not supported with backend={self.backend!r} "
                "(its kernel takes a scalar temperature over every row and column); "
                f"use backend in {', '.join(n for n in BACKEND_CHOICES if backend_capabilities(n).row_selection)}"
            )

    def _check_replay(self, capabilities) -> None:
        if self.replay is None:
            return
        if not isinstance(self.replay, SamplingReplay):
            raise ValueError(
                "FusedOutputProcessorContext.replay: expected None or a SamplingReplay, got "
                f"{type(self.replay).__name__}"
            )
        self._refuse_for_op(
            capabilities,
            "replay",
            "replayed_log_probs",
            "replayed_log_probs",
            (
                *self._two_pass_only_fields(),
                ("top_k", self.top_k > 0),
                ("calculate_sum_pi_squared", self.calculate_sum_pi_squared),
                ("calculate_log_probs", not self.calculate_log_probs),
            ),
        )

    def _two_pass_only_fields(self) -> tuple[tuple[str, bool], ...]:
        """The fields (name, set) of the two-pass op alone, which the token and replay ops take none of."""
        return (
            ("loss_fn", self.loss_fn is not None),
            ("keep_logits_bytes", self.keep_logits_bytes > 0),
            ("as_tuple", self.as_tuple),
        )

    def _refuse_for_op(self, capabilities, field: str, op: str, runs: str, conflicts) -> None:
        """ValueError naming `field` when the backend has no kernel for `op` (the selected-token kernels), or when
        one of `conflicts` (name, set) is set: `field` runs `runs`, which takes none of them."""
        if not capabilities.selected_tokens:
            raise ValueError(
                f"FusedOutputProcessorContext.{field}: needs the op {op}, which backend={self.backend!r} "
                f"has no kernel for; use backend in "
                f"{', '.join(n for n in BACKEND_CHOICES if backend_capabilities(n).selected_tokens)}"
            )
        for other, used in conflicts:
            if used:
                raise ValueError(
                    f"FusedOutputProcessorContext.{field}: runs the op {runs}, which takes no {other}; set one or the "
                    "other"
                )

    def _check_token_fields(self, capabilities) -> None:
        check_int("FusedOutputProcessorContext.top_k", self.top_k, low=0)
        check_bool("FusedOutputProcessorContext.calculate_sum_pi_squared", self.calculate_sum_pi_squared)
        check_bool("FusedOutputProcessorContext.calculate_log_probs", self.calculate_log_probs)
        if self.token_ids is not None and (
            not isinstance(self.token_ids, torch.Tensor)
            or self.token_ids.is_floating_point()
            or self.token_ids.is_complex()
            or self.token_ids.dtype == torch.bool
            or self.token_ids.dim() != 3
        ):
            raise ValueError(
                "FusedOutputProcessorContext.token_ids: expected None or an integer tensor [b, s, k] shaped like "
                "labels plus a last dim of ids"
            )
        if not self.asks_token_outputs:
            return
        asked = next(
            name
            for name, used in (
                ("token_ids", self.token_ids is not None),
                ("top_k", self.top_k > 0),
                ("calculate_sum_pi_squared", self.calculate_sum_pi_squared),
                ("calculate_log_probs", True),
            )
            if used
        )
        self._refuse_for_op(
            capabilities, asked, "token_log_probs", "token_log_probs (two passes)", self._two_pass_only_fields()
        )
