"""The op `replayed_log_probs`: log-probs and entropy renormalized over each row's kept set (sampling replay).

Why: a rollout sampled with top-k / top-p returns log-probs renormalized over the tokens its truncation kept (vLLM's
`processed_logprobs`), while the trainer's are over the whole vocabulary; their ratio carries the kept mass as a
bias. Replaying the kept set S of each token in the trainer (DeepSeek-V3.2's "Keep Sampling Mask") gives
log p_S(y) = z_y - logsumexp_{j in S} z_j with z = logits / T, and a gradient that is zero outside S. Neither needs
the other columns: per row only |S| rows of the output weight.

How: rows go in chunks; a chunk's kept ids on this rank's shard are made unique (U), the chunk's logits at U come
from one GEMM against W[U] (neighbouring tokens share most of their sets, so |U| is far below rows x |S|), and each
row reads its own columns. The backward forms the [chunk, |U|] d_logits, two more GEMMs give d_hidden and
d_weight[U], and d_weight[U] adds into one fp32 sum over the rows' union (indices unique per add: no atomics to
order). With `batch_invariant` a row's logits and d_hidden come from fp32 products added in an order fixed by the
hidden size and the set's width (`ordered_sum`), not from a GEMM whose kernel cuBLAS picks by shape: the same bits
whatever batch the row sits in. Across tensor-parallel ranks only the [rows, |S|] logits travel (one SUM all-reduce
of one rank's value plus exact zeros); d_hidden is completed as `tp_hidden` says.

Trainer-side replay (no sets given): the sets come from the row's own logits with vLLM's rule (kept_sets.py), found
by `token_log_probs`' top candidates in one no-grad pass over the vocabulary; everything after is sparse.
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..checks import check_int, is_number
from ..log_once import log_once
from .arguments import LogProbProblem, build_problem
from .backends import BACKEND_CHOICES
from .kept_sets import (
    DEFAULT_MAX_KEPT,
    FIRST_CANDIDATES,
    check_given_sets,
    first_position,
    padded_from_csr,
    vllm_kept_prefix,
)
from .selected_tokens import token_log_probs
from .softmax_math import ordered_sum
from .two_pass import fp32_backward
from .weight_gradient import returned_weight_grad

logger = logging.getLogger(__name__)

# Kept ids per chunk of the GEMM path (rows = this / the mean set size, within the bounds below): at most this many
# distinct columns, so a chunk's W[U] copy and GEMM stay near what gathering each row's |S| weight rows would cost,
# and neighbouring rows' shared ids are read once; enough rows that per-chunk launches and host syncs (the union's
# size) do not dominate (measured on the H100: 256-row chunks at |S| = 20 spent 54 ms on 16384 rows).
UNION_CHUNK_ENTRIES = 32768
UNION_CHUNK_ROWS = (64, 4096)
# The batch-invariant path's fp32 products [rows, |S|, H] per chunk.
INVARIANT_CHUNK_BYTES = 256 * 1024**2


class ReplayedLogProbs(NamedTuple):
    """`replayed_log_probs`' outputs, shaped like labels (plus a last dim where listed); 0 (ids -1) on rows not
    computed. Differentiable: log_probs, entropy, token_log_probs."""

    log_probs: Tensor  # [...] fp32 log p_S(label)
    entropy: Tensor | None  # [...] fp32 entropy of p_S
    kept_ids: Tensor  # int64 [..., k_max] each row's kept set, -1 padding (trainer-side: highest logit first)
    token_log_probs: Tensor | None  # [..., k] fp32 log p_S(token_ids), -inf for an id outside the row's set
    kept_mass: Tensor | None  # [...] fp32 trainer-side: the kept set's probability over the whole vocabulary
    label_added: Tensor | None  # [...] bool trainer-side: the label fell outside the rule's set and was added to it


def replayed_log_probs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    temperature: float | Tensor = 1.0,
    kept_ids: Tensor | None = None,
    kept_csr: tuple[Tensor, Tensor] | None = None,
    top_k: int = -1,
    top_p: float = 1.0,
    max_kept: int = DEFAULT_MAX_KEPT,
    token_ids: Tensor | None = None,
    tp_group: dist.ProcessGroup | None = None,
    tp_hidden: str = "replicated",
    score_mask: Tensor | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    calculate_entropy: bool = True,
    batch_invariant: bool = False,
    backend: str = "auto",
    chunk_rows: int | None = None,
    gradient_accumulation_fusion: bool = False,
) -> ReplayedLogProbs:
    """Log-prob of `labels`, entropy and (optionally) log-probs of `token_ids`, each renormalized over the row's kept
    set S under softmax(hidden @ W.T / temperature), W every rank's `weight` shard; gradients touch only the
    columns in S, and nothing [rows, vocab] is ever formed.

    Arguments as `log_probs_and_entropy`'s (hidden, weight, labels, temperature, tp_group, tp_hidden, score_mask,
    ignore_index, vocab_size, calculate_entropy, gradient_accumulation_fusion, batch_invariant), and one source of
    the kept sets:
        kept_ids: integer [..., k_max], leading dims as labels': each row's kept global ids, -1 padding, each id
            once, the label among them (ValueError otherwise). Every TP rank passes the same.
        kept_csr: (token_ids [nnz], offsets [rows + 1]), vLLM's `SamplingMask` layout, one row per label in labels'
            flattened order (rows not computed may be empty).
        top_k, top_p: no sets given: compute them from the row's own logits with vLLM's rule (top_k -1: off, else
            >= 1; top_p in (0, 1], 1: off), from `token_log_probs`' top candidates.
        backend: "auto" (Triton's kernels where the Triton backend runs: CUDA, Hopper, bf16; else the portable
            path), "triton" or "torch"; the candidates' pass uses it too.
        max_kept: the widest kept set allowed (given or computed; >= top_k); a wider one is a ValueError.
        token_ids: integer [..., k]: also return log p_S at these ids (-inf where an id is outside S).
        chunk_rows: the portable path's rows per chunk (None: 32768 kept ids' worth, 64-4096 rows; under
            batch_invariant, what fits 256 MiB of fp32 products). A row's values do not depend on it under
            batch_invariant. Triton's kernels take every row at once.

    A label outside a computed set (trainer-side only: the trainer's logits differ from the rollout's in the last
    bits, so a token at the top-p boundary can fall out) is added to its set and marked in `label_added`, with a
    log line; never a -inf log-prob. See docs/op.md, "Sampling replay".
    """
    given = kept_ids is not None or kept_csr is not None
    truncating = top_k != -1 or top_p != 1.0
    _check_replay_arguments(kept_ids, kept_csr, top_k, top_p, max_kept, chunk_rows, given, truncating)
    problem = build_problem(
        hidden, weight, labels, temperature=temperature, tp_group=tp_group, score_mask=score_mask,
        ignore_index=ignore_index, vocab_size=vocab_size, calculate_entropy=calculate_entropy, tile_rows=None,
        tp_hidden=tp_hidden, gradient_accumulation_fusion=gradient_accumulation_fusion,
        batch_invariant=batch_invariant,
    )  # fmt: skip
    scored_labels = problem.labels.index_select(0, problem.active_rows)
    kept_mass = label_added = None
    if given:
        kept = _given_rows(problem, kept_ids, kept_csr, labels)
        field = "kept_ids" if kept_ids is not None else "kept_csr"
        label_position = check_given_sets(kept, scored_labels, problem.vocab_size, max_kept, field)
    else:
        finder = dict(
            temperature=temperature, backend=backend, tp_group=tp_group, tp_hidden=tp_hidden,
            ignore_index=ignore_index, vocab_size=vocab_size, batch_invariant=batch_invariant,
        )  # fmt: skip
        kept, label_position, mass, added = _computed_sets(
            hidden, weight, labels, problem, score_mask, finder, top_k=top_k, top_p=top_p, max_kept=max_kept
        )

        kept_mass, label_added = _full(problem, mass, 0.0), _full(problem, added, False)
    token_position = _token_positions(problem, token_ids, labels, kept)
    plan = _SparsePlan(problem, kept, label_position, token_position, chunk_rows, _uses_triton(problem, backend))
    with torch.autocast(device_type=problem.hidden.device.type, enabled=False):
        if problem.needs_grad:
            log_probs, entropy, token_lp = _ReplayedSoftmax.apply(problem.hidden, problem.weight, plan)
        else:
            with torch.no_grad():
                log_probs, entropy, token_lp = _ReplayedSoftmax.forward(None, problem.hidden, problem.weight, plan)
    shape = labels.shape
    return ReplayedLogProbs(
        _full(problem, log_probs, 0.0).view(shape),
        None if entropy is None else _full(problem, entropy, 0.0).view(shape),
        _full(problem, kept, -1).view(*shape, kept.shape[1]),
        None if token_lp is None else _full(problem, token_lp, 0.0).view(*shape, token_lp.shape[1]),
        None if kept_mass is None else kept_mass.view(shape),
        None if label_added is None else label_added.view(shape),
    )


def _check_replay_arguments(kept_ids, kept_csr, top_k, top_p, max_kept, chunk_rows, given, truncating) -> None:
    check_int("max_kept", max_kept, low=1, expected="must be an int >= 1")
    check_int("chunk_rows", chunk_rows, low=1, optional=True, expected="must be an int >= 1 or None")
    if not (isinstance(top_k, int) and not isinstance(top_k, bool) and (top_k == -1 or top_k >= 1)):
        raise ValueError(f"top_k: expected -1 (off) or an int >= 1, got {top_k!r}")
    if not is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p: expected a number in (0, 1] (1: off), got {top_p!r}")
    if top_k > max_kept:
        raise ValueError(f"top_k: {top_k} exceeds max_kept={max_kept}; raise max_kept to at least top_k")
    if kept_ids is not None and kept_csr is not None:
        raise ValueError("kept_ids, kept_csr: pass the kept sets one way, not both")
    if given and truncating:
        raise ValueError(
            "top_k/top_p: the kept sets were given (kept_ids or kept_csr); top_k/top_p compute them in the trainer "
            "instead: pass one or the other"
        )
    if not given and not truncating:
        raise ValueError(
            "replayed_log_probs: nothing to replay: pass the rollout's kept sets (kept_ids or kept_csr) or its "
            "truncation (top_k and/or top_p)"
        )
    if kept_ids is not None and (
        not isinstance(kept_ids, Tensor) or kept_ids.dtype.is_floating_point or kept_ids.dtype == torch.bool
    ):
        raise ValueError("kept_ids: expected an integer torch.Tensor [..., k_max] (-1 padding)")
    if kept_csr is not None and not (isinstance(kept_csr, (tuple, list)) and len(kept_csr) == 2):
        raise ValueError("kept_csr: expected a pair (token_ids, offsets) of 1-d integer tensors")


def _uses_triton(p: LogProbProblem, backend: str) -> bool:
    """The sparse passes' path: Triton's gather-dot kernels where the Triton backend runs (CUDA, Hopper, bf16), the
    portable chunks elsewhere; "auto" says once why it passes Triton over on CUDA, "triton" refuses."""
    if backend not in BACKEND_CHOICES or backend == "verl":
        allowed = ", ".join(name for name in BACKEND_CHOICES if name != "verl")
        raise ValueError(f"backend: {backend!r} cannot run replayed_log_probs; allowed: {allowed}")
    if backend == "torch":
        return False
    from .backends import triton_backend

    reason = triton_backend.unavailable_reason(p)
    if reason is not None and backend == "triton":
        raise ValueError(f"backend: 'triton' cannot run replayed_log_probs here: {reason}")
    if reason is not None and p.hidden.is_cuda:
        log_once(logger, f"replayed_log_probs: the portable path, not Triton's kernels: {reason}", logging.WARNING)
    return reason is None


def _given_rows(p: LogProbProblem, kept_ids: Tensor | None, kept_csr, labels: Tensor) -> Tensor:
    """int64 [scored rows, k_max] of the given sets, trimmed to the widest scored row."""
    if kept_csr is not None:
        token_ids, offsets = kept_csr
        padded = padded_from_csr(token_ids.to(p.hidden.device), offsets.to(p.hidden.device), p.num_rows)
    else:
        if kept_ids.dim() != labels.dim() + 1 or kept_ids.shape[:-1] != labels.shape:
            raise ValueError(
                f"kept_ids: must be shaped like labels {tuple(labels.shape)} plus a last dim [..., k_max], got "
                f"{tuple(kept_ids.shape)}"
            )
        padded = kept_ids.to(p.hidden.device).reshape(p.num_rows, kept_ids.shape[-1]).long()
    scored = padded.index_select(0, p.active_rows)
    width = int((scored >= 0).sum(dim=1).max()) if scored.numel() else 0
    # left-align each row's ids (padding may sit anywhere), keeping their order
    order = torch.sort((scored < 0).to(torch.int8), dim=1, stable=True).indices
    return scored.gather(1, order)[:, :width]


def _computed_sets(hidden, weight, labels, p: LogProbProblem, score_mask, finder: dict, *, top_k, top_p, max_kept):
    """Trainer-side replay: (kept ids [A, k], the label's position, the kept mass, label added) per scored row.
    Candidates from `token_log_probs` (no grad; the row's top-c by logit, equal logits by lower id first; `finder`:
    its arguments); rows whose set may reach past them are fetched again with max_kept + 1 candidates."""
    vocab, rows = p.vocab_size, p.active_rows
    first = min(top_k + 1 if top_k > 0 else min(FIRST_CANDIDATES, max_kept + 1), vocab)
    candidates = functools.partial(_candidate_sets, hidden, weight, labels, score_mask, finder, top_k, top_p, vocab)
    ids, prefix = candidates(rows, first)
    count, mass, unresolved = prefix.count, prefix.mass, prefix.unresolved
    wider = min(max_kept + 1, vocab)
    if bool(unresolved.any()) and wider > first:
        more_ids, more = candidates(rows[unresolved], wider)
        ids = torch.cat([ids, ids.new_full((ids.shape[0], wider - first), -1)], 1)
        ids[unresolved] = more_ids
        count[unresolved], mass[unresolved] = more.count, more.mass
        still = torch.zeros_like(unresolved)
        still[unresolved] = more.unresolved
        unresolved = still
    too_many = unresolved | (count > max_kept)
    if bool(too_many.any()):
        row = int(too_many.nonzero()[0])
        raise ValueError(
            f"max_kept: scored row {row}'s kept set under top_k={top_k}, top_p={top_p} holds more than "
            f"max_kept={max_kept} ids; raise max_kept (or sample with a smaller top_p / top_k)"
        )
    scored_labels = p.labels.index_select(0, rows)
    ids = torch.cat([ids, ids.new_full((ids.shape[0], 1), -1)], 1)  # room for an added label
    slot = torch.arange(ids.shape[1], device=ids.device)
    inside = slot < count.unsqueeze(1)
    added = ~((ids == scored_labels.unsqueeze(1)) & inside).any(dim=1)
    # an added label goes right after its row's own set, so a row's layout never depends on the other rows
    at_end = (slot == count.unsqueeze(1)) & added.unsqueeze(1)
    kept = torch.where(inside, ids, torch.where(at_end, scored_labels.unsqueeze(1), -1))
    width = int((count + added).max()) if count.numel() else 0
    kept = kept[:, :width]
    if bool(added.any()):
        log_once(
            logger,
            "sampling replay: a label fell outside the kept set computed from the trainer's logits (it sits at "
            "the top-k/top-p boundary, where the trainer's and the rollout's logits differ in the last bits); it "
            "is added to its set and marked in label_added",
            logging.WARNING,
            later=logging.DEBUG,  # said once as a warning, then at DEBUG each time
        )
    return kept, first_position(kept == scored_labels.unsqueeze(1)), mass, added


def _candidate_sets(hidden, weight, labels, score_mask, finder, top_k, top_p, vocab, rows: Tensor, count: int):
    """The `count` top candidates of `rows` (int64 [R, count], -1 past the vocabulary) and vLLM's rule on them."""
    mask = torch.zeros(labels.numel(), dtype=torch.bool, device=rows.device).index_fill_(0, rows, True)
    if score_mask is not None:
        mask &= score_mask.reshape(-1).to(mask.device)
    with torch.no_grad():
        found = token_log_probs(
            hidden.detach(), weight.detach(), labels, score_mask=mask.view(labels.shape), top_k=count,
            calculate_log_probs=False, calculate_entropy=False, **finder,
        )  # fmt: skip
    top_ids = found.top_ids.reshape(-1, count).index_select(0, rows)
    top_log_probs = found.top_log_probs.reshape(-1, count).index_select(0, rows)
    top_log_probs = torch.where(top_ids >= 0, top_log_probs, float("-inf"))
    return top_ids, vllm_kept_prefix(top_log_probs, top_k, top_p, vocab)


def _token_positions(p: LogProbProblem, token_ids: Tensor | None, labels: Tensor, kept: Tensor) -> Tensor | None:
    """int64 [A, k]: each asked id's position in its row's kept set, -1 outside it."""
    if token_ids is None:
        return None
    if not isinstance(token_ids, Tensor) or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
        raise ValueError("token_ids: expected an integer torch.Tensor [..., k] or None")
    if token_ids.dim() != labels.dim() + 1 or token_ids.shape[:-1] != labels.shape:
        raise ValueError(
            f"token_ids: must be shaped like labels {tuple(labels.shape)} plus a last dim of ids [..., k], got "
            f"{tuple(token_ids.shape)}"
        )
    ids = token_ids.to(p.hidden.device).reshape(p.num_rows, -1).index_select(0, p.active_rows).long()
    match = (ids.unsqueeze(2) == kept.unsqueeze(1)) & (kept >= 0).unsqueeze(1)
    return torch.where(match.any(dim=2), first_position(match), -1)


def _full(p: LogProbProblem, values: Tensor | None, fill) -> Tensor | None:
    """values of the scored rows [A, ...] in a full-length [N, ...] tensor holding `fill` elsewhere (differentiable)."""
    if values is None:
        return None
    out = torch.full((p.num_rows, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    return out.index_copy(0, p.active_rows, values)


class _SparsePlan:
    """What the sparse passes need beside hidden and weight: the scored rows, their kept ids as this shard's columns
    (-1 elsewhere), the label's and the asked ids' positions in the sets, 1/T, the path (`triton`: the gather-dot
    kernels; else the portable chunks)."""

    def __init__(self, p: LogProbProblem, kept: Tensor, label_position: Tensor, token_position, chunk_rows, triton):
        self.p, self.kept, self.triton = p, kept, triton
        self.valid = kept >= 0
        local = kept - p.vocab_start
        self.columns = torch.where(self.valid & (local >= 0) & (local < p.valid_columns), local, -1)
        self.label_position, self.token_position = label_position, token_position
        active = p.active_rows.numel()
        if isinstance(p.temperature, Tensor):
            self.inv_temp = 1.0 / p.temperature.index_select(0, p.active_rows)
        else:
            self.inv_temp = torch.full((active,), 1.0 / p.temperature, device=kept.device)
        width, hidden_size = max(kept.shape[1], 1), p.hidden.shape[1]
        if chunk_rows is None:
            mean_set = max(1, int(self.valid.sum()) // max(active, 1))
            chunk_rows = min(max(UNION_CHUNK_ENTRIES // mean_set, UNION_CHUNK_ROWS[0]), UNION_CHUNK_ROWS[1])
            if p.batch_invariant:
                chunk_rows = max(1, INVARIANT_CHUNK_BYTES // (4 * width * hidden_size))
        self.spans = [slice(s, min(s + chunk_rows, active)) for s in range(0, active, chunk_rows)]
        self.mixed = p.weight.is_cuda and p.weight.dtype in (torch.bfloat16, torch.float16)

    def operands(self, span: slice):
        """The chunk's hidden rows, its unique columns U on this shard, W[U] and each entry's position in U (-1: not
        on this shard); operands fp32 unless tensor cores take them."""
        columns = self.columns[span]
        on = columns >= 0
        union, inverse = torch.unique(columns[on], return_inverse=True)
        position = torch.full_like(columns, -1)
        position[on] = inverse
        rows = self.p.hidden.index_select(0, self.p.active_rows[span])
        w_union = self.p.weight.index_select(0, union)
        if not self.mixed:
            rows, w_union = rows.float(), w_union.float()
        return rows, union, w_union, position

    def gemm(self, a: Tensor, b: Tensor) -> Tensor:
        """fp32 a @ b (bf16/fp16 operands on CUDA: tensor cores accumulating in fp32)."""
        if self.mixed:
            return torch.mm(a.to(b.dtype), b, out_dtype=torch.float32)
        return a.float() @ b.float()


def _shard_logits(plan: _SparsePlan) -> Tensor:
    """fp32 [A, k] raw logits h . W[id] of the kept ids on this shard, 0 elsewhere."""
    if plan.triton:  # token_log_probs' gather-dot: each W row read in place, fp32 in a fixed order over H
        from .backends.triton_selected_tokens import token_logits

        return token_logits(_scored_hidden(plan.p), plan.p.weight, plan.columns, torch.ones_like(plan.inv_temp))
    out = torch.zeros(plan.kept.shape, dtype=torch.float32, device=plan.kept.device)
    for span in plan.spans:
        rows, union, w_union, position = plan.operands(span)
        if not union.numel():
            continue
        on = position >= 0
        if plan.p.batch_invariant:  # fp32 products, the H terms added in a fixed order
            gathered = w_union.float()[position.clamp_min(0)]
            values = ordered_sum((gathered * rows.float().unsqueeze(1)).movedim(2, 0))
        else:
            values = plan.gemm(rows, w_union.t()).gather(1, position.clamp_min(0))
        out[span] = torch.where(on, values, 0.0)
    return out


def _all_ranks(values: Tensor, p: LogProbProblem) -> Tensor:
    """Each entry's one rank's value plus exact zeros: the same on every rank whatever the summation order."""
    if p.tp_world_size > 1:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=p.tp_group)
    return values


class _ReplayedSoftmax(torch.autograd.Function):
    """Forward: the kept ids' logits, their softmax statistics over each set; saves the [A, k] logits (as large as
    the ids) and three numbers per row. Backward: d_logits over the sets, d_hidden per row and d_weight at the
    sets' columns."""

    @staticmethod
    def forward(ctx, hidden, weight, plan: _SparsePlan):
        z = _all_ranks(_shard_logits(plan), plan.p) * plan.inv_temp.unsqueeze(1)
        z = torch.where(plan.valid, z, float("-inf"))
        row_max = z.amax(dim=1) if z.shape[1] else torch.zeros(z.shape[0], device=z.device)
        shifted = torch.where(plan.valid, z - row_max.unsqueeze(1), 0.0)
        exps = torch.where(plan.valid, shifted.exp(), 0.0)
        log_sum = ordered_sum(exps.t()).log() if z.shape[1] else torch.zeros_like(row_max)
        shifted_mean = ordered_sum((exps * shifted).t()) / log_sum.exp() if z.shape[1] else torch.zeros_like(row_max)
        log_probs = shifted.gather(1, plan.label_position.unsqueeze(1)).squeeze(1) - log_sum
        entropy = log_sum - shifted_mean if plan.p.calculate_entropy else None
        token_lp = None
        if plan.token_position is not None:
            picked = shifted.gather(1, plan.token_position.clamp_min(0)) - log_sum.unsqueeze(1)
            token_lp = torch.where(plan.token_position >= 0, picked, float("-inf"))
        if ctx is not None:
            ctx.plan = plan
            ctx.save_for_backward(shifted, log_sum, shifted_mean)
            ctx.set_materialize_grads(False)
            ctx.main_grad_owner = weight if plan.p.main_grad_dtype is not None else None
            ctx.shapes = (hidden.shape, hidden.dtype, weight.shape, weight.dtype)
        return log_probs, entropy, token_lp

    @staticmethod
    @once_differentiable
    @fp32_backward
    def backward(ctx, grad_log_probs, grad_entropy, grad_token_lp):
        shifted, log_sum, shifted_mean = ctx.saved_tensors
        plan, owner = ctx.plan, ctx.main_grad_owner
        ctx.plan = ctx.main_grad_owner = None
        hidden_shape, hidden_dtype, weight_shape, weight_dtype = ctx.shapes
        probs = torch.where(plan.valid, (shifted - log_sum.unsqueeze(1)).exp(), 0.0)
        d_z = torch.zeros_like(probs)
        if grad_log_probs is not None:
            g = grad_log_probs.float()
            d_z.scatter_add_(1, plan.label_position.unsqueeze(1), g.unsqueeze(1))
            d_z -= g.unsqueeze(1) * probs
        if grad_entropy is not None:
            d_z += grad_entropy.float().unsqueeze(1) * probs * (shifted_mean.unsqueeze(1) - shifted)
        if grad_token_lp is not None and plan.token_position is not None:
            inside = plan.token_position >= 0
            c = torch.where(inside, grad_token_lp.float(), 0.0)
            d_z.scatter_add_(1, plan.token_position.clamp_min(0), c)
            d_z -= ordered_sum(c.t()).unsqueeze(1) * probs
        d_raw = torch.where(plan.valid, d_z * plan.inv_temp.unsqueeze(1), 0.0)
        gradients = _triton_gradients if plan.triton else _sparse_gradients
        return gradients(plan, d_raw, ctx.needs_input_grad, owner, hidden_shape, hidden_dtype, weight_shape,
                                 weight_dtype)  # fmt: skip


def _sparse_gradients(plan: _SparsePlan, d_raw, needs, owner, hidden_shape, hidden_dtype, weight_shape, weight_dtype):
    """d_hidden (this shard's part, per row) and d_weight (at the sets' columns) from [A, k] d_logits."""
    device = d_raw.device
    grad_hidden = torch.zeros(hidden_shape, dtype=hidden_dtype, device=device) if needs[0] else None
    # d_weight's rows at the union of the sets' columns, summed in fp32 and rounded once: straight into an fp32
    # main_grad, else into a buffer of the union's rows (at most the shard's; flat in the row count)
    union_all = torch.unique(plan.columns[plan.columns >= 0]) if needs[1] or owner is not None else None
    into_main_grad = owner is not None and owner.main_grad.dtype == torch.float32
    weight_sum = None
    if union_all is not None and not into_main_grad:
        weight_sum = torch.zeros(union_all.numel(), weight_shape[1], dtype=torch.float32, device=device)
    for span in plan.spans:
        rows, union, w_union, position = plan.operands(span)
        if not union.numel():
            continue
        on = position >= 0
        d_chunk = torch.where(on, d_raw[span], 0.0)
        dense = torch.zeros(d_chunk.shape[0], union.numel(), dtype=torch.float32, device=device)
        dense.scatter_add_(1, position.clamp_min(0), d_chunk)  # ids are unique per row: one nonzero per slot
        if grad_hidden is not None:
            if plan.p.batch_invariant:
                gathered = w_union.float()[position.clamp_min(0)]
                d_rows = ordered_sum((gathered * d_chunk.unsqueeze(2)).movedim(1, 0))
            else:
                d_rows = plan.gemm(dense, w_union)
            grad_hidden.index_copy_(0, plan.p.active_rows[span], d_rows.to(hidden_dtype))
        if into_main_grad:  # unique indices: each row of main_grad gets one add per chunk, in chunk order
            owner.main_grad.index_add_(0, union, plan.gemm(dense.t(), rows))
        elif weight_sum is not None:
            weight_sum.index_add_(0, torch.searchsorted(union_all, union), plan.gemm(dense.t(), rows))
    grad_weight = None
    if owner is not None:
        if not into_main_grad:
            owner.main_grad.index_add_(0, union_all, weight_sum.to(owner.main_grad.dtype))
        grad_weight = returned_weight_grad(owner)
    elif needs[1]:
        grad_weight = torch.zeros(weight_shape, dtype=weight_dtype, device=device)
        grad_weight.index_copy_(0, union_all, weight_sum.to(weight_dtype))
    return grad_hidden, grad_weight, None


# Hidden units per program of the Triton backward's kernels.
GRADIENT_BLOCK_H = 256


def _scored_hidden(p: LogProbProblem) -> Tensor:
    """The scored rows of hidden, contiguous [A, H] (hidden itself when every row is scored)."""
    if p.active_rows.numel() == p.num_rows:
        return p.hidden.contiguous()
    return p.hidden.index_select(0, p.active_rows)


def _triton_gradients(plan: _SparsePlan, d_raw, needs, owner, hidden_shape, hidden_dtype, weight_shape, weight_dtype):
    """The Triton backward: d_hidden per row from its kept weight rows (`kept_rows_gradient_kernel`), d_weight per
    kept column from the hidden rows that kept it (`kept_columns_gradient_kernel`, over the entries sorted by
    column), straight into the returned gradient or main_grad: no [rows, |U|] or fp32 [|U|, H] buffer."""
    from .backends import triton_kernels as kernels

    p, device = plan.p, d_raw.device
    rows, entries = d_raw.shape
    size = hidden_shape[1]
    blocks = -(-size // GRADIENT_BLOCK_H)
    weight = p.weight.contiguous()
    grad_hidden = torch.zeros(hidden_shape, dtype=hidden_dtype, device=device) if needs[0] else None
    if grad_hidden is not None and rows and entries:
        kernels.kept_rows_gradient_kernel[(rows, blocks)](
            d_raw.contiguous(), plan.columns.contiguous(), weight, weight.stride(0), grad_hidden,
            grad_hidden.stride(0), p.active_rows, entries, size, BLOCK_H=GRADIENT_BLOCK_H,
        )  # fmt: skip
    target, grad_weight = None, None
    if owner is not None:
        target = owner.main_grad
    elif needs[1]:
        target = grad_weight = torch.zeros(weight_shape, dtype=weight_dtype, device=device)
    if target is not None and rows and entries:
        flat = plan.columns.reshape(-1)
        order = torch.sort(flat, stable=True).indices  # the -1 entries first, then each column's in row order
        order = order[int((flat < 0).sum()) :]
        columns, counts = torch.unique_consecutive(flat[order], return_counts=True)
        starts = torch.zeros(columns.numel() + 1, dtype=torch.int64, device=device)
        torch.cumsum(counts, 0, out=starts[1:])
        if columns.numel():
            hidden = p.hidden.contiguous()
            kernels.kept_columns_gradient_kernel[(columns.numel(), blocks)](
                p.active_rows[order // entries], d_raw.reshape(-1)[order].contiguous(), starts, columns, hidden,
                hidden.stride(0), target, target.stride(0), size, ACCUMULATE=owner is not None,
                BLOCK_H=GRADIENT_BLOCK_H,
            )  # fmt: skip
    if owner is not None:
        grad_weight = returned_weight_grad(owner)
    return grad_hidden, grad_weight, None
