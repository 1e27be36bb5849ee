"""Log-probs, entropy and a token-separable loss in one pass: each chunk's logits are computed once.

`log_probs_and_entropy` learns the upstream gradient only in backward, so it
recomputes the logits there (four GEMMs). Given the loss up front, each chunk of
scored rows is multiplied once: its statistics give the rows' log-probs and
entropy, the loss's per-row gradients of those rows (asked of the loss itself,
through autograd) turn the same logits (kept in fp16 by the Triton forward kernel
on CUDA, fp32 elsewhere) into d_logits, and the two gradient GEMMs run right away
(three GEMMs). The returned loss's backward only scales the
stored d_hidden and d_weight by the incoming gradient.

Why this is exact only for token-separable losses: a chunk's rows are
differentiated before later chunks' log-probs exist (they hold 0 then). So after
the last chunk the loss is evaluated once more on the real values and its
per-row gradients must equal those used; otherwise NonSeparableLossError. A
gradient reaching the returned log-probs or entropy in backward (a further loss
on them) raises LossGradientError: it would otherwise be dropped silently.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import chunk_elementwise
from .interface import build_problem
from .problem import LogProbProblem
from .statistics import combine_row_statistics
from .torch_backend import _Gemms

logger = logging.getLogger(__name__)

# loss_fn(log_probs, entropy or None), both fp32 shaped like labels -> (scalar loss, metrics)
LossFunction = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, Any]]
# row_gradients(rows, log_probs of those rows, entropy of those rows or None) -> (d loss/d log_prob,
# d loss/d entropy or None) of those rows: a cheap stand-in for differentiating loss_fn once per chunk.
RowGradients = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]

# Per-row gradients of a token-separable loss do not depend on other rows' values: the
# two evaluations agree to the last bits; anything beyond this is a dependency on other rows.
SEPARABILITY_RTOL = 1e-6


# Memory for one chunk of logits on CUDA (Triton): 2 bytes per logit, the forward kernel keeps them in fp16 and
# d_logits overwrites them. More rows per chunk add fewer times into the fp32 d_weight accumulator (V_local x H
# x 4 bytes, read and written once per chunk; there is none when one chunk holds every scored row), and leave
# more GPU work queued behind loss_fn's final evaluation, whose host time (~21 ms for verl's ppo_loss at 65k
# tokens) the last chunk's GEMMs must cover. On the H200 at 65536 x 2048 x 151936: 4 GiB (5 chunks) 0.84x
# the 4-GEMM floor, 2 GiB (10 chunks) 0.885x.
CHUNK_BUDGET_BYTES = 4 * 1024**3
# The portable passes (CPU, or CUDA without Triton): 4 bytes of fp32 logits per logit plus d_logits and the
# passes' temporaries, about three chunks at once; speed there is the GEMMs', so memory decides.
PORTABLE_CHUNK_BUDGET_BYTES = 2 * 1024**3

class NonSeparableLossError(RuntimeError):
    """The loss's gradient for a row depends on other rows: the one-pass gradient would be wrong."""


class LossGradientError(RuntimeError):
    """A gradient reached the log-probs or entropy returned next to the fused loss."""


@dataclass
class FusedLossResult:
    """loss: scalar, differentiable in hidden and weight; metrics: what loss_fn returned with it;
    log_probs, entropy: fp32 shaped like labels (entropy None unless asked); not to be differentiated."""

    loss: torch.Tensor
    metrics: Any
    log_probs: torch.Tensor
    entropy: torch.Tensor | None


@dataclass
class _LossCall:
    loss_fn: LossFunction
    loss_name: str
    shape: torch.Size
    row_gradients: RowGradients | None = None
    host_loss_fn: LossFunction | None = None
    metrics: Any = field(default=None)


def _evaluate(call: _LossCall, log_probs: torch.Tensor, entropy: torch.Tensor | None, with_grad: bool,
              loss_fn: LossFunction | None = None):
    """loss_fn (default call.loss_fn) on full-length values; with_grad: also its gradients in log_probs and
    entropy (zeros if unused)."""
    loss_fn = loss_fn or call.loss_fn
    if not with_grad:
        loss, metrics = loss_fn(log_probs.view(call.shape), None if entropy is None else entropy.view(call.shape))
        return loss, metrics, None, None
    with torch.enable_grad():
        lp = log_probs.detach().requires_grad_(True)
        ent = None if entropy is None else entropy.detach().requires_grad_(True)
        loss, metrics = loss_fn(lp.view(call.shape), None if ent is None else ent.view(call.shape))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn ({call.loss_name}): must return (scalar tensor, metrics), got {type(loss).__name__}")
        inputs = [lp] if ent is None else [lp, ent]
        grads = torch.autograd.grad(loss, inputs, allow_unused=True) if loss.requires_grad else [None] * len(inputs)
    g_lp = grads[0] if grads[0] is not None else torch.zeros_like(log_probs)
    g_ent = None
    if ent is not None:
        g_ent = grads[1] if grads[1] is not None else torch.zeros_like(entropy)
    return loss.detach().reshape(()), metrics, g_lp.float(), g_ent if g_ent is None else g_ent.float()


def _check_separable(call: _LossCall, used: torch.Tensor, exact: torch.Tensor, rows: torch.Tensor, what: str) -> None:
    used, exact = used.index_select(0, rows), exact.index_select(0, rows)
    scale = exact.abs().max() if exact.numel() else exact.new_zeros(())
    if not bool(((used - exact).abs() <= SEPARABILITY_RTOL * scale).all()):
        worst = float((used - exact).abs().max())
        if call.host_loss_fn is not None:
            raise NonSeparableLossError(
                f"loss {call.loss_name}: autograd of its host_loss_fn (the final evaluation, on the host) disagrees "
                f"with the gradients used in the {what} (by up to {worst:.3e}): host_loss_fn must be loss_fn over "
                "host copies of its inputs, and the loss token-separable"
            )
        if call.row_gradients is not None:
            raise NonSeparableLossError(
                f"loss {call.loss_name}: its row_gradients disagree with autograd of the loss in the {what} "
                f"(by up to {worst:.3e}); the fused gradient would be wrong"
            )
        raise NonSeparableLossError(
            f"loss {call.loss_name}: its gradient in the {what} of a row depends on other rows' values "
            f"(per-chunk and whole-batch gradients differ by up to {worst:.3e}), so it is not token-separable "
            "and cannot be fused; compute it on the outputs of log_probs_and_entropy instead"
        )


def _chunk_row_gradients(call: _LossCall, rows, log_probs, entropy, chunk_log_probs, chunk_entropy):
    """fp32 (g_lp, g_ent) of the chunk's rows: from call.row_gradients, else by differentiating loss_fn on
    full-length values (rows not yet computed hold 0). g_ent is zeros when the entropy is not computed."""
    if call.row_gradients is not None:
        g_lp, g_ent = call.row_gradients(rows, chunk_log_probs, chunk_entropy)
    else:
        _, _, g_lp_all, g_ent_all = _evaluate(call, log_probs, entropy, with_grad=True)
        g_lp = g_lp_all.index_select(0, rows)
        g_ent = None if g_ent_all is None else g_ent_all.index_select(0, rows)
    g_lp = g_lp.float()
    if g_ent is None or chunk_entropy is None:
        return g_lp, torch.zeros_like(g_lp)
    return g_lp, g_ent.float()


def _label_columns(p: LogProbProblem, rows: torch.Tensor) -> torch.Tensor:
    local = p.labels.index_select(0, rows) - p.vocab_start
    return torch.where((local >= 0) & (local < p.valid_columns), local, torch.full_like(local, -1))


def _inverse_temperature(p: LogProbProblem, rows: torch.Tensor) -> torch.Tensor:
    if isinstance(p.temperature, torch.Tensor):
        return p.temperature.index_select(0, rows).reciprocal()
    return torch.full((rows.numel(),), 1.0 / p.temperature, dtype=torch.float32, device=rows.device)


class _WeightGradient:
    """d_weight summed over chunks: the only chunk's GEMM writes it directly; several add into an fp32
    [valid_columns, H] accumulator, rounded once at the end."""

    def __init__(self, p: LogProbProblem, chunks: int):
        self.d_weight = torch.empty_like(p.weight)
        self.d_weight[p.valid_columns :].zero_()
        self.target = self.d_weight[: p.valid_columns]
        self.accumulator = None
        if chunks > 1:
            self.accumulator = torch.empty(self.target.shape, dtype=torch.float32, device=p.weight.device)
        self.added = 0

    def add(self, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
        beta = min(self.added, 1)  # 0 on the first chunk: the buffer's old contents are ignored, NaN included
        self.added += 1
        if self.accumulator is None:
            if grad_logits.dtype == self.target.dtype:
                torch.mm(grad_logits.t(), h, out=self.target)
            else:
                self.target.copy_(grad_logits.t() @ h)
        elif grad_logits.dtype == torch.float32:
            self.accumulator.addmm_(grad_logits.t(), h, beta=beta)
        else:
            torch.addmm(self.accumulator, grad_logits.t(), h, beta=beta, out_dtype=torch.float32, out=self.accumulator)

    def result(self) -> torch.Tensor:
        if self.accumulator is not None:
            self.target.copy_(self.accumulator)
        return self.d_weight


class _PortableChunks:
    """Each chunk's fp32 logits materialized by cuBLAS/CPU GEMMs (`_Gemms`), the two elementwise passes in
    torch (`chunk_elementwise`): 4 bytes per logit plus d_logits."""

    def __init__(self, p: LogProbProblem, chunk_rows: int | None, budget: int | None):
        self.p, self.gemms = p, _Gemms(p.weight, p.valid_columns)
        budget = budget or PORTABLE_CHUNK_BUDGET_BYTES
        self.rows = chunk_rows or max(1, budget // (4 * max(1, p.valid_columns)))

    def statistics(self, rows, label_col, inv_temp):
        self.h = self.gemms.rows(self.p.hidden, rows)
        self.raw = self.gemms.raw_logits(self.h)
        return chunk_elementwise.chunk_statistics(self.raw, label_col, inv_temp)

    def gradients(self, label_col, inv_temp, row_max, log_sum, shifted_mean, g_lp, g_ent, weight_gradient):
        out_dtype = self.p.weight.dtype if self.gemms.mixed else torch.float32
        grad_logits = chunk_elementwise.chunk_grad_logits(
            self.raw, label_col, inv_temp, row_max, log_sum, shifted_mean, g_lp, g_ent, out_dtype
        )
        self.raw = None
        weight_gradient.add(grad_logits, self.h)
        return self.gemms.grad_hidden(grad_logits).to(self.p.hidden.dtype)


class _StoredChunks:
    """CUDA, Triton: the forward kernel reduces each chunk's logits to statistics and keeps them in fp16
    (`triton_backend.StoredLogits`); the gradient pass overwrites them with d_logits in place
    (`triton_chunk_kernels`). 2 bytes per logit, one buffer reused by every chunk. Without gradients
    (`keep=False`) nothing is kept, and every scored row goes through the kernel at once."""

    def __init__(self, p: LogProbProblem, chunk_rows: int | None, keep: bool, budget: int | None):
        from .triton_backend import FORWARD_CONFIG, tma_ready

        self.p, self.weight = p, tma_ready(p.weight)
        self.columns = p.valid_columns
        pitch = -(-self.columns // 8) * 8  # TMA: 16-byte aligned rows
        tiles = -(-self.columns // FORWARD_CONFIG.block_n)
        active = max(1, p.active_rows.numel())
        self.store = self.buffer = self.tile_max = None
        if not keep:
            self.rows = active
            return
        if chunk_rows is None:
            row_bytes, block = 2 * pitch + 4 * tiles, FORWARD_CONFIG.block_m
            budget = budget or CHUNK_BUDGET_BYTES
            # One chunk when it fits in what several would take with their fp32 d_weight accumulator.
            if active * row_bytes <= budget + 4 * self.columns * p.hidden.shape[1]:
                fit = active
            else:
                fit = max(block, budget // row_bytes // block * block)
            chunk_rows = -(-active // -(-active // fit))  # equal chunks
        self.rows = chunk_rows = min(chunk_rows, active)
        self.buffer = torch.empty(chunk_rows, pitch, dtype=torch.float16, device=p.weight.device)
        self.tile_max = torch.empty(chunk_rows, tiles, dtype=torch.float32, device=p.weight.device)

    def statistics(self, rows, label_col, inv_temp):
        from .triton_backend import StoredLogits, local_statistics, tma_ready

        count = rows.numel()
        self.h = tma_ready(self.p.hidden.index_select(0, rows))
        if self.buffer is not None:
            self.store = StoredLogits(self.buffer[:count, : self.columns], self.tile_max[:count])
        return local_statistics(self.p, self.h, self.weight, label_col, inv_temp, self.store)

    def gradients(self, label_col, inv_temp, row_max, log_sum, shifted_mean, g_lp, g_ent, weight_gradient):
        from .triton_chunk_kernels import stored_grad_logits

        grad_logits = stored_grad_logits(
            self.store, label_col, inv_temp, row_max, log_sum, shifted_mean, g_lp, g_ent, self.p.hidden.dtype
        )
        weight_gradient.add(grad_logits, self.h)
        return torch.mm(grad_logits, self.weight[: self.columns])


@functools.cache
def _log_portable_on_cuda(reason: str) -> None:
    logger.warning("log_probs_entropy_and_loss: %s; portable fp32 chunk passes on CUDA (slower, more memory)", reason)


def _chunk_passes(p: LogProbProblem, chunk_rows: int | None, keep: bool, budget: int | None):
    """The Triton passes where the Triton backend can run `p`, else the portable ones (said once on CUDA);
    keep: the logits are needed again for the gradients; budget: bytes of a chunk (None: the default)."""
    if p.hidden.device.type == "cuda":
        try:
            from . import triton_backend, triton_chunk_kernels  # noqa: F401  (Triton importable)
        except ImportError as error:
            _log_portable_on_cuda(f"Triton unavailable ({error})")
        else:
            reason = triton_backend.unavailable_reason(p)
            if reason is None:
                return _StoredChunks(p, chunk_rows, keep, budget)
            _log_portable_on_cuda(reason)
    return _PortableChunks(p, chunk_rows, budget)


class _HostCopy:
    """Host copies of the final values, enqueued in stream order right after the last chunk's statistics and
    row gradients, ahead of its gradient GEMMs: pinned buffers the copy engine fills while the GEMMs run;
    `values()` waits for that copy only. Off CUDA the tensors are already on the host."""

    def __init__(self, *tensors: torch.Tensor | None):
        self.event = None
        if tensors[0].device.type != "cuda":
            self.copies = tensors
            return
        self.copies = tuple(
            None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
            for t in tensors
        )
        self.sources = tensors  # kept alive (and unreused by the allocator) until the copy is done
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(tensors[0].device))  # the stream the copies were queued on

    def values(self) -> tuple[torch.Tensor | None, ...]:
        if self.event is not None:
            self.event.synchronize()
            self.sources = None
        return self.copies


def _evaluate_on_host(call: _LossCall, copy: _HostCopy, device: torch.device):
    """host_loss_fn's final evaluation and the separability check, on the host copies; the loss back on `device`."""
    log_probs, entropy, g_lp_used, g_ent_used, active_rows = copy.values()
    loss, metrics, g_lp_exact, g_ent_exact = _evaluate(call, log_probs, entropy, True, loss_fn=call.host_loss_fn)
    _check_separable(call, g_lp_used, g_lp_exact, active_rows, "log-prob")
    if g_ent_used is not None:
        _check_separable(call, g_ent_used, g_ent_exact, active_rows, "entropy")
    if device.type == "cuda":
        return loss.pin_memory().to(device, non_blocking=True), metrics
    return loss, metrics


@functools.cache
def _evaluation_stream(device: torch.device) -> torch.cuda.Stream:
    """One high-priority stream per device for loss_fn's final evaluation (its kernels go first when SMs free up).
    Reused by every call: each use first waits for the main stream, so blocks it frees are safe to reuse."""
    return torch.cuda.Stream(device, priority=-100)


def _one_pass(p: LogProbProblem, call: _LossCall, want_grads: bool, chunk_rows: int | None, budget: int | None):
    """Chunk by chunk: logits once, statistics, the loss's row gradients, d_logits, both input gradients.
    Returns (loss, metrics, log_probs [N], entropy [N] or None, d_hidden or None, d_weight or None)."""
    device, n, n_active = p.hidden.device, p.num_rows, p.active_rows.numel()
    passes = _chunk_passes(p, chunk_rows, want_grads, budget) if p.valid_columns > 0 else None
    step = passes.rows if passes is not None else max(1, n_active)
    log_probs = torch.zeros(n, dtype=torch.float32, device=device)
    entropy = torch.zeros(n, dtype=torch.float32, device=device) if p.calculate_entropy else None
    g_lp_used = torch.zeros(n, dtype=torch.float32, device=device) if want_grads else None
    g_ent_used = torch.zeros(n, dtype=torch.float32, device=device) if want_grads and p.calculate_entropy else None
    d_hidden = torch.zeros_like(p.hidden) if want_grads else None
    weight_gradient = _WeightGradient(p, -(-n_active // step)) if want_grads else None
    # The final evaluation should overlap the last chunk's gradient GEMMs. With host_loss_fn it runs on host
    # copies of the final values (taken ahead of those GEMMs): nothing it does waits for the GPU. Otherwise
    # (CUDA) loss_fn runs on a high-priority stream that waits only for the last chunk's statistics; cuBLAS's
    # persistent GEMMs still hold its small kernels, and with them each of its host synchronizations, until
    # they finish.
    host = call.host_loss_fn is not None and want_grads
    host_copy = None
    evaluation = None
    if want_grads and not host and isinstance(passes, _StoredChunks) and device.type == "cuda":
        evaluation = _evaluation_stream(device)
    main = torch.cuda.current_stream(device) if evaluation is not None else None
    last_start = (n_active - 1) // step * step
    for start in range(0, n_active, step):
        rows = p.active_rows[start : start + step]
        label_col, inv_temp = _label_columns(p, rows), _inverse_temperature(p, rows)
        if passes is not None:
            partials = passes.statistics(rows, label_col, inv_temp)
        else:  # a shard of padding only: no mass, still part of the TP merge
            zeros = torch.zeros(rows.numel(), dtype=torch.float32, device=device)
            partials = (torch.full_like(zeros, float("-inf")), zeros, zeros, zeros)
        lp, ent, row_max, log_sum, shifted_mean = combine_row_statistics(p, *partials)
        log_probs.index_copy_(0, rows, lp)
        if entropy is not None:
            entropy.index_copy_(0, rows, ent)
        if not want_grads:
            continue
        g_lp, g_ent = _chunk_row_gradients(call, rows, log_probs, entropy, lp, ent)
        g_lp_used.index_copy_(0, rows, g_lp)
        if g_ent_used is not None:
            g_ent_used.index_copy_(0, rows, g_ent)
        if host and start == last_start:
            host_copy = _HostCopy(log_probs, entropy, g_lp_used, g_ent_used, p.active_rows)
        if passes is None:
            continue
        if evaluation is not None and start == last_start:
            evaluation.wait_stream(main)
        d_hidden.index_copy_(
            0, rows, passes.gradients(label_col, inv_temp, row_max, log_sum, shifted_mean, g_lp, g_ent, weight_gradient)
        )
    if host_copy is not None:
        loss, metrics = _evaluate_on_host(call, host_copy, device)
        return loss, metrics, log_probs, entropy, d_hidden, weight_gradient.result()
    with contextlib.ExitStack() as on_evaluation_stream:
        if evaluation is not None:
            on_evaluation_stream.enter_context(torch.cuda.stream(evaluation))
        try:
            loss, metrics, g_lp_exact, g_ent_exact = _evaluate(call, log_probs, entropy, with_grad=want_grads)
            if want_grads:
                _check_separable(call, g_lp_used, g_lp_exact, p.active_rows, "log-prob")
                if g_ent_used is not None:
                    _check_separable(call, g_ent_used, g_ent_exact, p.active_rows, "entropy")
        finally:
            if evaluation is not None:  # what it computed is used on the main stream from here on
                main.wait_stream(evaluation)
    d_weight = weight_gradient.result() if want_grads else None
    return loss, metrics, log_probs, entropy, d_hidden, d_weight


def _scaled(gradient: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if bool(scale == 1):
        return gradient
    return (gradient.float() * scale.float()).to(gradient.dtype)


class _FusedLogProbEntropyLoss(torch.autograd.Function):
    """Forward does all the work; backward scales the stored input gradients by d(result)/d(loss)."""

    @staticmethod
    def forward(ctx, hidden, weight, p: LogProbProblem, call: _LossCall, chunk_rows: int | None, budget: int | None):
        loss, call.metrics, log_probs, entropy, d_hidden, d_weight = _one_pass(p, call, True, chunk_rows, budget)
        ctx.d_hidden, ctx.d_weight, ctx.loss_name = d_hidden, d_weight, call.loss_name
        ctx.set_materialize_grads(False)
        return loss, log_probs, (entropy if entropy is not None else torch.zeros_like(log_probs))

    @staticmethod
    @once_differentiable  # second-order gradients are not implemented: raise, never return wrong ones
    def backward(ctx, grad_loss, grad_log_probs, grad_entropy):
        for name, grad in (("log-probs", grad_log_probs), ("entropy", grad_entropy)):
            if grad is not None and bool(grad.ne(0).any()):
                raise LossGradientError(
                    f"loss {ctx.loss_name}: a gradient reached the {name} returned by log_probs_entropy_and_loss; "
                    "the fused op only back-propagates its own loss, so a further loss on its outputs would be "
                    "dropped. Fold that term into loss_fn, or use log_probs_and_entropy"
                )
        if grad_loss is None:
            return None, None, None, None, None, None
        grad_hidden = _scaled(ctx.d_hidden, grad_loss) if ctx.needs_input_grad[0] else None
        grad_weight = _scaled(ctx.d_weight, grad_loss) if ctx.needs_input_grad[1] else None
        ctx.d_hidden = ctx.d_weight = None
        return grad_hidden, grad_weight, None, None, None, None


def log_probs_entropy_and_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    loss_fn: LossFunction,
    loss_name: str,
    temperature: float | torch.Tensor = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    score_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    calculate_entropy: bool = True,
    chunk_rows: int | None = None,
    row_gradients: RowGradients | None = None,
    host_loss_fn: LossFunction | None = None,
    chunk_bytes: int | None = None,
) -> FusedLossResult:
    """`loss_fn(log_probs, entropy)` of `log_probs_and_entropy`'s outputs, its gradient computed in the same pass.

    Arguments as `log_probs_and_entropy` (same checks), plus:
        loss_fn: (log_probs, entropy or None), fp32 shaped like labels -> (scalar loss, metrics). Must be
            token-separable (row i's gradient depends on row i's values only) and deterministic; it is
            called once per chunk of rows and once more on the final values, identically on every TP rank.
        loss_name: names the loss in errors.
        chunk_rows: scored rows per chunk (default: a chunk of logits near CHUNK_BUDGET_BYTES on CUDA,
            PORTABLE_CHUNK_BUDGET_BYTES elsewhere; on CUDA every scored row in one chunk where that fits
            in the budget plus the fp32 d_weight accumulator).
        row_gradients: optional (rows, their log_probs, their entropy or None) -> (g_lp, g_ent or None),
            the loss's gradients for the given flat rows; spares a whole-batch loss_fn call per chunk.
            Checked like the separability: against autograd of loss_fn after the last chunk.
        host_loss_fn: optional, the same loss over host (CPU) tensors: its captured data on the host. When
            gradients are computed, the final evaluation (loss value, metrics, separability check) calls it
            on host copies of the final log-probs and entropy, taken ahead of the last chunk's gradient
            GEMMs, so none of its synchronizations waits for them; the loss comes back on hidden's device.
            Its gradients are checked against those used, like row_gradients.
        chunk_bytes: the chunk budget in bytes, in place of CHUNK_BUDGET_BYTES / PORTABLE_CHUNK_BUDGET_BYTES
            (ignored when chunk_rows is given).

    Returns FusedLossResult: `loss` back-propagates into hidden and weight (TP: partial d_hidden, as
    `log_probs_and_entropy`); `metrics` come from the final evaluation. Backward raises LossGradientError
    if a gradient reaches the returned log_probs/entropy; the forward raises NonSeparableLossError when
    loss_fn is not token-separable.
    """
    if not callable(loss_fn):
        raise ValueError(f"loss_fn: expected a callable (log_probs, entropy) -> (loss, metrics), got {type(loss_fn).__name__}")
    if not isinstance(loss_name, str) or not loss_name:
        raise ValueError(f"loss_name: expected a non-empty str, got {loss_name!r}")
    p = build_problem(
        hidden,
        weight,
        labels,
        temperature=temperature,
        tp_group=tp_group,
        score_mask=score_mask,
        ignore_index=ignore_index,
        vocab_size=vocab_size,
        calculate_entropy=calculate_entropy,
        tile_rows=chunk_rows,
    )
    for name, value in (("row_gradients", row_gradients), ("host_loss_fn", host_loss_fn)):
        if value is not None and not callable(value):
            raise ValueError(f"{name}: expected None or a callable, got {type(value).__name__}")
    if chunk_bytes is not None and (isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1):
        raise ValueError(f"chunk_bytes: expected None or an int >= 1 (bytes), got {chunk_bytes!r}")
    call = _LossCall(
        loss_fn=loss_fn, loss_name=loss_name, shape=labels.shape, row_gradients=row_gradients, host_loss_fn=host_loss_fn
    )
    # fp32 whatever the caller's autocast says, as log_probs_and_entropy (its backward only scales)
    with torch.autocast(device_type=p.hidden.device.type, enabled=False):
        if not p.needs_grad:
            with torch.no_grad():
                loss, metrics, log_probs, entropy, _, _ = _one_pass(p, call, False, chunk_rows, chunk_bytes)
        else:
            loss, log_probs, entropy = _FusedLogProbEntropyLoss.apply(p.hidden, p.weight, p, call, chunk_rows, chunk_bytes)
            metrics = call.metrics
            entropy = entropy if p.calculate_entropy else None
    return FusedLossResult(
        loss=loss,
        metrics=metrics,
        log_probs=log_probs.view(labels.shape),
        entropy=None if entropy is None else entropy.view(labels.shape),
    )
