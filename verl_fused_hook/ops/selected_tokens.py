"""The op `token_log_probs`: log-probs of several given ids per row, the row's own top-k and sum pi^2, without logits.

Why: distillation from a teacher's top-k (verl's forward_kl_topk) needs the student's log-probs at k given ids per
token, and its metrics the student's own top-k; the Optimal Token Baseline needs sum_j p_j^2. verl reads all three
off [tokens, vocab / TP] logits. Here they come out of the same tiles as `log_probs_and_entropy`'s statistics (two
passes: statistics in forward, logits recomputed in backward), and only per-row values cross tensor-parallel ranks.

Gradient: of sum_j c_j log p(id_j) (plus the label's and the entropy's) the d_logits are the label gradient's dense
part with coefficient g_lp + sum_j c_j, plus a sparse part: g_lp at the label and c_j at each id (token_math.py). The
backends fold the sparse part into the d_logits chunks their backward already forms, so the same three GEMMs carry
it: no extra GEMM, no [N, k, H] gather in backward.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..checks import check_bool, check_int
from .arguments import LogProbProblem, build_problem
from .backends import BACKEND_CHOICES, BACKENDS, check_backend_name, resolve_backend
from .softmax_math import LogitGradientInputs, Partials, combine_row_statistics, no_column_partials
from .token_math import (
    SparseLogitGradient,
    TokenPartials,
    TokenRequest,
    merge_token_partials,
    no_column_token_partials,
)
from .two_pass import fp32_backward
from .weight_gradient import InputGradients

DRIVER = "token_log_probs"


class TokenLogProbs(NamedTuple):
    """`token_log_probs`'s outputs, fp32 unless said, shaped like labels plus a last dim where listed; None when
    not asked. Differentiable: log_probs, entropy, token_log_probs."""

    log_probs: Tensor | None  # [...] log p(label)
    entropy: Tensor | None  # [...]
    token_log_probs: Tensor | None  # [..., k] log p(token_ids[..., j])
    top_ids: (
        Tensor | None
    )  # int64 [..., top_k] the row's top_k global ids, highest logit first; -1 on rows not computed
    top_log_probs: Tensor | None  # [..., top_k] their log-probs
    sum_pi_squared: Tensor | None  # [...] sum_j p_j^2


def token_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    token_ids: Tensor | None = None,
    *,
    temperature: float | Tensor = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    tp_hidden: str = "replicated",
    score_mask: Tensor | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    calculate_log_probs: bool = True,
    calculate_entropy: bool = True,
    top_k: int = 0,
    calculate_sum_pi_squared: bool = False,
    backend: str = "auto",
    tile_rows: int | None = None,
    gradient_accumulation_fusion: bool = False,
    batch_invariant: bool = False,
    top_k_chunk_bytes: int | None = None,
) -> TokenLogProbs:
    """Log-probs of `labels` and of every id in `token_ids`, entropy, the row's own top_k and sum pi^2 under
    softmax(hidden @ W.T / temperature), W every rank's `weight` shard; no [rows, vocab] tensor at any point.

    Arguments as `log_probs_and_entropy`'s (hidden, weight, labels, temperature, tp_group, tp_hidden, score_mask,
    ignore_index, vocab_size, calculate_entropy, backend, tile_rows), and:
        token_ids: integer [..., k], leading dims as labels': global ids in [0, vocab_size) (read on computed rows
            only); any id may sit on any rank's shard, duplicates allowed. Under tensor parallelism every rank passes
            the same ids. None: no token_log_probs.
        calculate_log_probs: False: the label's log-prob is neither returned nor differentiated (labels still say
            which rows are computed, through ignore_index).
        top_k: int in [0, vocab_size]: also return the row's top_k ids and log-probs (no gradient), highest first,
            equal logits by lower id (at the top_k boundary too, on Triton always, on the portable backend with
            batch_invariant).
        calculate_sum_pi_squared: also return sum_j p_j^2 (no gradient).
        backend: "auto", "triton" or "torch"; "verl" has no such kernel (ValueError).
        tile_rows: the portable backend's rows per tile, as log_probs_and_entropy's.
        gradient_accumulation_fusion: True: d_weight goes into `weight.main_grad` and megatron's placeholder is
            returned, as log_probs_and_entropy's (so that every op call on one weight in a step treats it alike).
        batch_invariant: every forward output of a row the same bits whatever batch computes it, as
            log_probs_and_entropy's.
        top_k_chunk_bytes: Triton under top_k: the bytes one chunk of rows may hold (its kept fp32 logits and the
            top-k's selection; at least one row block). None: 1 GiB. More: fewer chunks and launches, more memory.
            A row's outputs do not depend on it.

    Rows not computed (ignore_index, score_mask False) hold 0 in every output (top_ids -1) and get zero gradient.
    Every rank of tp_group returns identical outputs and its own d_weight shard; d_hidden as tp_hidden says.
    See docs/op.md, "token_log_probs".
    """
    check_backend_name(backend)
    if backend != "auto" and not BACKENDS[backend].capabilities.selected_tokens:
        allowed = ", ".join(n for n in BACKEND_CHOICES if n == "auto" or BACKENDS[n].capabilities.selected_tokens)
        raise ValueError(
            f"backend: {backend!r} cannot run {DRIVER} (its kernel returns the label's log-prob and "
            f"entropy only); allowed: {allowed}"
        )
    check_bool("calculate_log_probs", calculate_log_probs)
    check_bool("calculate_sum_pi_squared", calculate_sum_pi_squared)
    check_int("top_k", top_k, low=0, expected="must be an int >= 0")
    if top_k_chunk_bytes is not None:
        check_int("top_k_chunk_bytes", top_k_chunk_bytes, low=1, expected="must be an int >= 1 or None")
    problem = build_problem(
        hidden, weight, labels, temperature=temperature, tp_group=tp_group, score_mask=score_mask,
        ignore_index=ignore_index, vocab_size=vocab_size, calculate_entropy=calculate_entropy, tile_rows=tile_rows,
        tp_hidden=tp_hidden, gradient_accumulation_fusion=gradient_accumulation_fusion,
        batch_invariant=batch_invariant,
    )  # fmt: skip
    check_int(
        "top_k",
        top_k,
        low=0,
        high=problem.vocab_size,
        expected=f"must be an int in [0, {problem.vocab_size}] (vocab_size)",
    )
    token_columns = _token_columns(problem, labels, token_ids)
    request = TokenRequest(token_columns, top_k, calculate_sum_pi_squared, top_k_chunk_bytes)
    with torch.autocast(device_type=problem.hidden.device.type, enabled=False):
        chosen = resolve_backend(backend, problem, DRIVER)
        module = importlib.import_module(chosen.selected_tokens_module, package=f"{__package__}.backends")
        if not problem.needs_grad:
            with torch.no_grad():
                outputs = _forward(problem, request, module.selected_token_passes(problem, request))[0]
        else:
            outputs = _SelectedTokens.apply(problem.hidden, problem.weight, problem, request, module)
    return _shaped(outputs, labels.shape, calculate_log_probs)


def _token_columns(p: LogProbProblem, labels: Tensor, token_ids: Tensor | None) -> Tensor | None:
    """int64 [scored rows, k]: each asked id as a column of this shard, -1 where another rank holds it. ValueError
    naming token_ids for a non-integer tensor, a shape that is not labels' plus one dim, or an id of a computed row
    outside [0, vocab_size) (one host read)."""
    if token_ids is None:
        return None
    if not isinstance(token_ids, Tensor):
        raise ValueError(f"token_ids: expected an integer torch.Tensor or None, got {type(token_ids).__name__}")
    if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
        raise ValueError(f"token_ids: must be an integer tensor, got {token_ids.dtype}")
    if token_ids.dim() != labels.dim() + 1 or token_ids.shape[:-1] != labels.shape:
        raise ValueError(
            f"token_ids: must be shaped like labels {tuple(labels.shape)} plus a last dim of ids [..., k], "
            f"got {tuple(token_ids.shape)}"
        )
    if token_ids.device != labels.device:
        raise ValueError(f"token_ids: must be on labels' device {labels.device}, got {token_ids.device}")
    ids = token_ids.reshape(p.num_rows, token_ids.shape[-1]).index_select(0, p.active_rows).long()
    bad = (ids < 0) | (ids >= p.vocab_size)
    if ids.numel() and bool(bad.any()):
        raise ValueError(
            f"token_ids: ids must lie in [0, {p.vocab_size}) (vocab_size) on every computed row, "
            f"found {ids[bad][0].item()}"
        )
    local = ids - p.vocab_start
    return torch.where((local >= 0) & (local < p.valid_columns), local, -1)


def _forward(p: LogProbProblem, request: TokenRequest, passes) -> tuple[tuple, tuple]:
    """(full-length outputs, what the backward needs: the merged statistics of the scored rows)."""
    active = p.active_rows.numel()
    if p.valid_columns == 0 or active == 0:
        partials = no_column_partials(active, p.hidden.device)
        extras = no_column_token_partials(active, request, p.hidden.device)
    else:
        parts = [passes.token_statistics(block) for block in passes.blocks()]
        partials = Partials(*(_cat(column) for column in zip(*(part[0] for part in parts))))
        extras = TokenPartials(*(_cat(column) for column in zip(*(part[1] for part in parts))))
    statistics = combine_row_statistics(p, partials)
    results = merge_token_partials(
        extras, statistics.row_max, partials.row_max, statistics.log_sum, p.tp_group, p.tp_world_size
    )
    outputs = (
        _full(p, statistics.log_probs, 0.0),
        _full(p, statistics.entropy, 0.0),
        _full(p, results.token_log_probs, 0.0),
        _full(p, results.top_ids, -1),
        _full(p, results.top_log_probs, 0.0),
        _full(p, results.sum_pi_squared, 0.0),
    )
    return outputs, (statistics.row_max, statistics.log_sum, statistics.shifted_mean)


def _cat(column: tuple[Tensor | None, ...]) -> Tensor | None:
    if column[0] is None:
        return None
    return column[0] if len(column) == 1 else torch.cat(column)


def _full(p: LogProbProblem, values: Tensor | None, fill) -> Tensor | None:
    """values of the scored rows [A, ...] placed in a full-length [N, ...] tensor holding `fill` elsewhere."""
    if values is None:
        return None
    out = torch.full((p.num_rows, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    return out.index_copy_(0, p.active_rows, values)


def _shaped(outputs: tuple, shape: torch.Size, calculate_log_probs: bool) -> TokenLogProbs:
    log_probs, entropy, token_lp, top_ids, top_lp, sum_pi_squared = outputs
    rows = lambda t: None if t is None else t.view(shape)  # noqa: E731
    per_id = lambda t: None if t is None else t.view(*shape, t.shape[-1])  # noqa: E731
    return TokenLogProbs(
        rows(log_probs) if calculate_log_probs else None,
        rows(entropy),
        per_id(token_lp),
        per_id(top_ids),
        per_id(top_lp),
        rows(sum_pi_squared),
    )


class _SelectedTokens(torch.autograd.Function):
    """Saves the passes' tensors, the merged statistics (three fp32 numbers per scored row) and the ids' columns;
    the backward walks the same blocks, recomputing their logits, with the sparse part added to each block's
    d_logits."""

    @staticmethod
    def forward(ctx, hidden, weight, p: LogProbProblem, request: TokenRequest, module):
        passes = module.selected_token_passes(p, request)
        outputs, statistics = _forward(p, request, passes)
        saved = passes.for_backward()
        ctx.rebuild_passes = saved.rebuild
        ctx.save_for_backward(*saved.tensors, *statistics, request.token_columns)
        ctx.inputs = (hidden.shape, hidden.dtype, weight.shape, weight.dtype, p.valid_columns, p.calculate_entropy)
        # d_weight goes to its main_grad (main_grad_dtype is set only for a weight that requires grad)
        ctx.main_grad_owner = weight if p.main_grad_dtype is not None else None
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*(t for t in outputs[3:] if t is not None))
        return outputs

    @staticmethod
    @once_differentiable  # second-order gradients are not implemented: raise, never return wrong ones
    @fp32_backward
    def backward(ctx, grad_log_probs, grad_entropy, grad_token_log_probs, *_no_gradient):
        *tensors, row_max, log_sum, shifted_mean, token_columns = ctx.saved_tensors
        hidden_shape, hidden_dtype, weight_shape, weight_dtype, valid_columns, calculate_entropy = ctx.inputs
        device = row_max.device
        grad_entropy = grad_entropy if calculate_entropy else None
        owner, ctx.main_grad_owner = ctx.main_grad_owner, None
        grads = InputGradients(
            ctx.needs_input_grad, (hidden_shape, hidden_dtype), (weight_shape, weight_dtype), valid_columns,
            row_max.numel(), owner, device,
        )  # fmt: skip
        nothing_flows = grad_log_probs is None and grad_entropy is None and grad_token_log_probs is None
        if valid_columns == 0 or row_max.numel() == 0 or nothing_flows:
            return *grads.finish(), None, None, None
        passes = ctx.rebuild_passes(*tensors)
        grads.start(passes.block_count)
        for block in passes.blocks():
            span, rows = block.span, block.rows
            g_lp = _scored(grad_log_probs, rows)
            g_tokens = _scored(grad_token_log_probs, rows)
            dense, sparse = _dense_and_sparse(block.label_col, g_lp, token_columns, span, g_tokens)
            inputs = LogitGradientInputs(
                row_max[span], log_sum[span], shifted_mean[span], dense, _scored(grad_entropy, rows)
            )
            d_hidden = passes.token_gradients(block, inputs, sparse, grads.hidden is not None, grads.weight_sum)
            grads.store_hidden(block, d_hidden)
            del d_hidden  # gone before the next block's fp32 d_hidden is allocated
        return *grads.finish(), None, None, None


def _scored(grad: Tensor | None, rows: Tensor) -> Tensor | None:
    return None if grad is None else grad.index_select(0, rows).float()


def _dense_and_sparse(
    label_col: Tensor, g_lp: Tensor | None, token_columns: Tensor | None, span: slice, g_tokens: Tensor | None
):
    """The dense coefficient per row (g_lp + sum_j c_j; None when neither flows) and the sparse part: the label's
    column with g_lp and the ids' columns with c_j (a column may repeat: the backends combine them)."""
    label = label_col.long().unsqueeze(1)
    columns, coefficients, dense = [], [], None
    if g_lp is not None:
        columns.append(label)
        coefficients.append(g_lp.unsqueeze(1))
        dense = g_lp
    if g_tokens is not None and token_columns is not None:
        columns.append(token_columns[span])
        coefficients.append(g_tokens)
        dense = g_tokens.sum(dim=1) if dense is None else dense + g_tokens.sum(dim=1)
    if not columns:
        empty = torch.empty(label.shape[0], 0, device=label.device)
        return None, SparseLogitGradient(empty.long(), empty)
    return dense, SparseLogitGradient(torch.cat(columns, 1), torch.cat(coefficients, 1))
