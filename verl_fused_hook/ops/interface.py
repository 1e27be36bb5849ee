"""The public op: argument checks, normalization and backend dispatch."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .backends import BACKEND_CHOICES, resolve_backend
from .problem import LogProbProblem, default_tile_rows


def _tp_layout(tp_group) -> tuple[int, int]:
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        if tp_group is not None:
            raise ValueError("tp_group was given but torch.distributed is not initialized; pass tp_group=None for one rank")
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def check_temperature_values(field: str, temperature) -> None:
    """ValueError naming `field` unless `temperature` is a finite number > 0 or a tensor of such values."""
    if isinstance(temperature, torch.Tensor):
        if not bool(torch.isfinite(temperature).all()) or not bool((temperature > 0).all()):
            raise ValueError(f"{field}: every value must be finite and > 0")
        return
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"{field}: expected a float > 0 or a tensor, got {type(temperature).__name__}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"{field}: must be finite and > 0, got {temperature}")


def _check_temperature(temperature, labels: torch.Tensor, device: torch.device) -> float | torch.Tensor:
    """A float, or an fp32 [N] tensor of per-row temperatures."""
    check_temperature_values("temperature", temperature)
    if not isinstance(temperature, torch.Tensor):
        return float(temperature)
    if temperature.dim() == 0:
        return float(temperature.item())
    if temperature.shape != labels.shape:
        raise ValueError(
            f"temperature: a tensor must be 0-d or shaped like labels {tuple(labels.shape)}, got {tuple(temperature.shape)}"
        )
    return temperature.reshape(-1).to(device=device, dtype=torch.float32)


def log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    score_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    calculate_entropy: bool = True,
    backend: str = "auto",
    tile_rows: int | None = None,
    return_label_is_max: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-row log-probability of `labels` and entropy of softmax(hidden @ weight.T / temperature).

    Never materializes [rows, vocab] logits: rows are processed in tiles and the
    backward recomputes each tile's logits.

    Args:
        hidden: [..., H] rows (any float dtype; computed in fp32).
        weight: [V_local, H], this rank's contiguous vocabulary shard: rank r of
            `tp_group` holds global ids r*V_local ... (r+1)*V_local-1.
        labels: global token ids shaped like `hidden` without its last dim.
        temperature: float > 0, or a tensor of per-row temperatures shaped like labels.
        tp_group: the tensor-parallel group the vocabulary is sharded over (None: one rank).
        score_mask: bool tensor shaped like labels; False rows are not computed.
        ignore_index: label value of rows that are not computed.
        vocab_size: true global vocabulary; columns at or past it (padding) are
            excluded from the softmax. Default: V_local * tp size.
        calculate_entropy: when False the entropy is neither computed nor returned.
        backend: one of "auto", "torch" (and GPU kernels when installed).
        tile_rows: rows per tile; default keeps one fp32 logits tile near 256 MiB.
        return_label_is_max: also return, per row, whether the label's logit is the
            row maximum over the whole vocabulary (greedy acceptance, e.g. MTP's).

    Returns:
        (log_probs, entropy): float32, shaped like labels; entropy None if not asked.
        Rows not computed hold 0 and get zero gradient. With return_label_is_max a
        third output: bool shaped like labels, not differentiable, False on rows not
        computed; a label tied with another column at the maximum counts as True.

    Tensor-parallel contract (Megatron's convention): every rank passes the same
    full `hidden` and gets identical outputs. Backward returns each rank's
    *partial* d_hidden (its shard's contribution: the caller sums it over the
    group, as Megatron's copy_to_tensor_model_parallel_region or the
    sequence-parallel gather does in their backward) and the rank's own d_weight.
    """
    if backend not in BACKEND_CHOICES:
        raise ValueError(f"backend: unknown {backend!r}; allowed: {', '.join(BACKEND_CHOICES)}")
    if hidden.dim() < 1 or hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels: must be shaped like hidden without its last dim {tuple(hidden.shape[:-1])}, got {tuple(labels.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: must be [V_local, H] with H={hidden.shape[-1]} matching hidden, got {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError("weight: the vocabulary shard must hold at least one column")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"hidden/weight: must be floating point, got {hidden.dtype} and {weight.dtype}")
    if hidden.device != weight.device or labels.device != hidden.device:
        raise ValueError(f"hidden, weight, labels: must share one device, got {hidden.device}, {weight.device}, {labels.device}")
    if labels.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.bool):
        raise ValueError(f"labels: must be an integer tensor, got {labels.dtype}")
    if not isinstance(return_label_is_max, bool):
        raise ValueError(f"return_label_is_max: expected a bool, got {return_label_is_max!r}")
    if tile_rows is not None and (isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows < 1):
        raise ValueError(f"tile_rows: must be an int >= 1 or None, got {tile_rows!r}")

    tp_world_size, tp_rank = _tp_layout(tp_group)
    local_vocab = weight.shape[0]
    padded_vocab = local_vocab * tp_world_size
    if vocab_size is None:
        vocab_size = padded_vocab
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 1 <= vocab_size <= padded_vocab:
        raise ValueError(f"vocab_size: must be an int in [1, {padded_vocab}] (V_local * tp size), got {vocab_size!r}")

    flat_labels = labels.reshape(-1).long()
    scored = flat_labels != ignore_index
    if score_mask is not None:
        if score_mask.shape != labels.shape or score_mask.dtype != torch.bool:
            raise ValueError(
                f"score_mask: must be a bool tensor shaped like labels {tuple(labels.shape)}, got {score_mask.dtype} {tuple(score_mask.shape)}"
            )
        scored = scored & score_mask.reshape(-1).to(scored.device)
    out_of_range = (flat_labels != ignore_index) & ((flat_labels < 0) | (flat_labels >= vocab_size))
    if bool(out_of_range.any()):
        bad = flat_labels[out_of_range][0].item()
        raise ValueError(f"labels: ids must lie in [0, {vocab_size}) or equal ignore_index={ignore_index}, found {bad}")

    vocab_start = tp_rank * local_vocab
    problem = LogProbProblem(
        hidden=hidden.reshape(-1, hidden.shape[-1]),
        weight=weight,
        labels=flat_labels,
        temperature=_check_temperature(temperature, labels, hidden.device),
        active_rows=scored.nonzero().squeeze(1),
        vocab_start=vocab_start,
        valid_columns=max(0, min(local_vocab, vocab_size - vocab_start)),
        tp_group=tp_group if tp_world_size > 1 else None,
        tp_world_size=tp_world_size,
        calculate_entropy=bool(calculate_entropy),
        tile_rows=tile_rows if tile_rows is not None else default_tile_rows(local_vocab),
        label_is_max=torch.zeros(flat_labels.shape, dtype=torch.bool, device=hidden.device) if return_label_is_max else None,
    )
    log_probs, entropy = resolve_backend(backend, problem).load().run(problem)
    log_probs = log_probs.view(labels.shape)
    entropy = entropy.view(labels.shape) if entropy is not None else None
    if return_label_is_max:
        return log_probs, entropy, problem.label_is_max.view(labels.shape)
    return log_probs, entropy
