"""The two-pass op `log_probs_and_entropy`: statistics in forward, logits recomputed in backward.

Why two passes: the upstream gradient is known only in backward, so the forward keeps three
fp32 numbers per scored row (row max, log of the shifted sum-exp, shifted mean logit) and the
backward recomputes each block's logits from them (four GEMMs in all; three for the rows whose
logits `keep_logits_bytes` lets the Triton backend keep). The driver walks a
backend's blocks; across tensor-parallel ranks only the per-row statistics travel: one SUM all-reduce of every
rank's partials in its own slot, merged in rank order (batch invariant), plus the d_hidden reduction `tp_hidden`
asks for.

The op computes in fp32 whatever autocast the caller runs under, in its backward too: autocast would turn the
tile GEMMs into bf16 ones. The forward disables it around its work; a backward runs with the autocast state of
the thread that calls `.backward()` (on the CPU, the caller's own), so the backward disables it as well
(`fp32_backward`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..log_once import log_once
from .arguments import LogProbProblem, build_problem
from .backends import BlockBackend, BlockPasses, TwoPassPasses, check_backend_name, resolve_backend
from .softmax_math import (
    LogitGradientInputs,
    Partials,
    RowStatistics,
    combine_row_statistics,
    no_column_partials,
    scatter_rows,
)
from .weight_gradient import InputGradients

logger = logging.getLogger(__name__)


def log_probs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    tp_hidden: str = "replicated",
    score_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    calculate_entropy: bool = True,
    backend: str = "auto",
    tile_rows: int | None = None,
    return_label_is_max: bool = False,
    keep_logits_bytes: int = 0,
    gradient_accumulation_fusion: bool = False,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-row log-probability of `labels` and entropy of softmax(hidden @ weight.T / temperature).

    Never materializes [rows, vocab] logits: rows are processed in blocks and the
    backward recomputes each block's logits.

    Args:
        hidden: [..., H] rows (any float dtype; computed in fp32, also under torch.autocast).
            Under tensor parallelism laid out as `tp_hidden` says.
        weight: [V_local, H], this rank's contiguous vocabulary shard: rank r of
            `tp_group` holds global ids r*V_local ... (r+1)*V_local-1.
        labels: global token ids shaped like `hidden` without its last dim (every row: under
            tp_hidden="sequence_sharded" their dim 0 is tp size times hidden's).
        temperature: float > 0, or a floating tensor of per-row temperatures shaped like
            labels (no gradient flows to it: a tensor that requires grad is refused).
        tp_group: the tensor-parallel group the vocabulary is sharded over (None: one rank).
        tp_hidden: how `hidden` is laid out over tp_group, and so what its gradient is:
            "replicated" (default): every rank passes the same full `hidden`; backward
            all-reduces d_hidden, so each rank gets the complete gradient (Megatron's
            copy_to_tensor_model_parallel_region).
            "sequence_sharded": each rank passes its slice of hidden's dim 0 (sequence
            parallelism); the op all-gathers it and backward reduce-scatters d_hidden, so each
            rank gets the complete gradient of its slice (Megatron's
            gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=True)).
            "partial": every rank passes the full `hidden` and gets its shard's partial
            d_hidden; the caller sums it over the group (verl's kernel's contract).
            Ignored with one rank.
        score_mask: bool tensor shaped like labels; False rows are not computed.
        ignore_index: label value of rows that are not computed.
        vocab_size: true global vocabulary; columns at or past it (padding) are
            excluded from the softmax. Default: V_local * tp size.
        calculate_entropy: when False the entropy is neither computed nor returned.
        backend: one of BACKEND_CHOICES: "auto" (Triton where it runs, else torch),
            "triton", "torch", "verl" (verl's own kernel: every row, one float temperature).
        tile_rows: rows per tile; default keeps one fp32 logits tile near 256 MiB.
        return_label_is_max: also return, per row, whether the label's logit is the
            row maximum over the whole vocabulary (greedy acceptance, e.g. MTP's).
        keep_logits_bytes: memory (per rank) the op may hold from forward to backward to keep
            the logits of as many scored rows as fit, in fp16 (2 bytes per logit and a few per
            row), so the backward skips their recompute: one GEMM of four per kept row. 0
            (default): recompute every row, extra memory one tile whatever the rows. Taken by
            the "triton" backend; the others recompute every row and say so once in a log line.
        gradient_accumulation_fusion: True: the backward adds d_weight into `weight.main_grad` (set by
            Megatron's DistributedDataParallel; ValueError here without it) instead of returning it, and returns
            Megatron's placeholder (weight_gradient.py), as megatron's linear layers do with the config field of that
            name. An fp32 main_grad is then also the backward's fp32 sum of d_weight, so the Triton backend
            walks small groups of rows, its working memory flat in the row count. Not with backend "verl"
            (its kernel returns d_weight itself): ValueError.
        batch_invariant: True: a row's log-prob and entropy must have the same bits whatever batch computes it
            (its size, the row's position, the other rows and the mask), at a fixed TP size. Backends "triton"
            and "verl", and "torch" on the CPU, give that either way (the Triton forward merges each column
            tile's partial in an order fixed by the width, docs/op.md); "torch" on CUDA cannot (ValueError
            with True; with False (default) its values may differ in the last bits between batches).

    Returns:
        (log_probs, entropy): float32, shaped like labels; entropy None if not asked.
        Rows not computed hold 0 and get zero gradient. With return_label_is_max a
        third output: bool shaped like labels, not differentiable, False on rows not
        computed; a label tied with another column at the maximum counts as True.

    Every rank of tp_group gets identical outputs and its own d_weight shard.
    """
    check_backend_name(backend)
    problem = build_problem(
        hidden,
        weight,
        labels,
        temperature=temperature,
        tp_group=tp_group,
        score_mask=score_mask,
        ignore_index=ignore_index,
        vocab_size=vocab_size,
        calculate_entropy=calculate_entropy,
        tile_rows=tile_rows,
        return_label_is_max=return_label_is_max,
        tp_hidden=tp_hidden,
        keep_logits_bytes=keep_logits_bytes,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
        batch_invariant=batch_invariant,
        # no gradient: the labels are read after the kernels (verl's kernel gathers by label: read before it)
        defer_label_check=backend != "verl" and not _wants_grad(hidden, weight),
    )
    # fp32 whatever the caller's autocast says: a bf16 forward would leave the backward (which
    # recomputes in fp32, see fp32_backward) working against bf16 statistics.
    with torch.autocast(device_type=problem.hidden.device.type, enabled=False):
        chosen = resolve_backend(backend, problem)
        if keep_logits_bytes and not chosen.capabilities.keep_logits:
            log_once(
                logger,
                f"log_probs_and_entropy: keep_logits_bytes={keep_logits_bytes} ignored: backend "
                f"{chosen.name!r} recomputes every row's logits (only 'triton' keeps them)",
                key=chosen.name,
                every_rank=True,
            )
        module = chosen.load()
        if problem.main_grad_dtype is not None and chosen.whole_problem:
            raise ValueError(
                f"gradient_accumulation_fusion=True: backend {chosen.name!r} returns d_weight from its own kernel and "
                "cannot add it into main_grad; choose backend 'auto', 'triton' or 'torch', or turn "
                "gradient_accumulation_fusion off (on the output layer: megatron's config field of that name)"
            )
        if chosen.whole_problem:
            log_probs, entropy = module.run(problem)
        else:
            log_probs, entropy = run_passes(problem, module)
    label_is_max = problem.label_is_max
    if problem.label_check is not None:
        labelled = problem.label_check.finish()
        if labelled is not None:
            log_once(
                logger,
                f"log_probs_and_entropy: rows labelled ignore_index={ignore_index} were computed too, then zeroed: "
                "without gradients the op launches its kernels before it reads the labels; pass "
                "score_mask=(labels != ignore_index) to skip them",
                key="ignored rows computed",
                later=logging.DEBUG,
            )
            unlabelled = ~labelled
            log_probs, entropy, label_is_max = (
                None if t is None else t.masked_fill(unlabelled, 0) for t in (log_probs, entropy, label_is_max)
            )
    log_probs = log_probs.view(labels.shape)
    entropy = entropy.view(labels.shape) if entropy is not None else None
    if return_label_is_max:
        return log_probs, entropy, label_is_max.view(labels.shape)
    return log_probs, entropy


def _wants_grad(hidden, weight) -> bool:
    """Whether the op will build a graph (LogProbProblem.needs_grad, before the problem is built)."""
    requires_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in (hidden, weight))
    return torch.is_grad_enabled() and requires_grad


def run_passes(problem: LogProbProblem, module: BlockBackend) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full-length fp32 (log_probs, entropy or None) of a built problem through a block backend's two-pass passes,
    differentiable when the problem needs gradients; the loss-inside op's two-pass path reuses its problem."""
    if not problem.needs_grad:
        with torch.no_grad():
            statistics = _statistics(problem, module.two_pass_passes(problem, False))
        return scatter_rows(problem, statistics.log_probs), scatter_rows(problem, statistics.entropy)
    return _TwoPass.apply(problem.hidden, problem.weight, problem, module.two_pass_passes)


def _statistics(p: LogProbProblem, passes: BlockPasses) -> RowStatistics:
    """The statistics of the scored rows, block by block."""
    if p.valid_columns == 0 or p.active_rows.numel() == 0:
        partials = no_column_partials(p.active_rows.numel(), p.hidden.device)
    else:
        parts = [passes.statistics(block) for block in passes.blocks()]
        partials = parts[0] if len(parts) == 1 else Partials(*(torch.cat(column) for column in zip(*parts)))
    return combine_row_statistics(p, partials)


def _scored(grad: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    return None if grad is None else grad.index_select(0, rows).float()


def fp32_backward(backward):
    """Run an autograd Function's backward with autocast off on every device type."""

    @functools.wraps(backward)
    def without_autocast(ctx, *grads):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return backward(ctx, *grads)

    return without_autocast


class _TwoPass(torch.autograd.Function):
    """Saves what the backend's passes need (the inputs by reference, or a compacted copy of the scored rows)
    plus three fp32 numbers per scored row; the backward walks the same blocks, recomputing their logits."""

    @staticmethod
    def forward(ctx, hidden, weight, p: LogProbProblem, two_pass_passes: Callable[..., TwoPassPasses]):
        passes = two_pass_passes(p, True)
        statistics = _statistics(p, passes)
        saved = passes.for_backward()
        ctx.rebuild_passes = saved.rebuild
        ctx.save_for_backward(*saved.tensors, statistics.row_max, statistics.log_sum, statistics.shifted_mean)
        ctx.inputs = (hidden.shape, hidden.dtype, weight.shape, weight.dtype)
        ctx.layout = (p.valid_columns, p.calculate_entropy)
        # d_weight goes to its main_grad (main_grad_dtype is set only for a weight that requires grad)
        ctx.main_grad_owner = weight if p.main_grad_dtype is not None else None
        ctx.set_materialize_grads(False)
        return scatter_rows(p, statistics.log_probs), scatter_rows(p, statistics.entropy)

    @staticmethod
    @once_differentiable  # second-order gradients are not implemented: raise, never return wrong ones
    @fp32_backward
    def backward(ctx, grad_log_probs, grad_entropy):
        *tensors, row_max, log_sum, shifted_mean = ctx.saved_tensors
        hidden_shape, hidden_dtype, weight_shape, weight_dtype = ctx.inputs
        valid_columns, calculate_entropy = ctx.layout
        device = row_max.device
        if not calculate_entropy:
            grad_entropy = None
        owner, ctx.main_grad_owner = ctx.main_grad_owner, None
        grads = InputGradients(
            ctx.needs_input_grad, (hidden_shape, hidden_dtype), (weight_shape, weight_dtype), valid_columns,
            row_max.numel(), owner, device,
        )  # fmt: skip
        if valid_columns == 0 or row_max.numel() == 0 or (grad_log_probs is None and grad_entropy is None):
            return *grads.finish(), None, None
        passes = ctx.rebuild_passes(*tensors)
        grads.start(passes.block_count)
        for block in passes.blocks():
            span = block.span
            inputs = LogitGradientInputs(
                row_max[span],
                log_sum[span],
                shifted_mean[span],
                _scored(grad_log_probs, block.rows),
                _scored(grad_entropy, block.rows),
            )  # the block's d_hidden is gone before the next block's fp32 one is allocated
            grads.store_hidden(block, passes.gradients(block, inputs, grads.hidden is not None, grads.weight_sum))
        return *grads.finish(), None, None
