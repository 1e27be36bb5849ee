"""The loss-inside op `log_probs_entropy_and_loss`: log-probs, entropy and a token-separable loss in one
pass, each chunk's logits computed once.

`log_probs_and_entropy` learns the upstream gradient only in backward, so it recomputes the
logits there (four GEMMs). Given the loss up front, each chunk of scored rows is multiplied
once: its statistics give the rows' log-probs and entropy, the loss's per-row gradients of
those rows (separability.py) turn the same logits, kept by the backend's passes, into
d_logits, and the two gradient GEMMs run right away (three GEMMs). The returned loss's
backward only scales the stored d_hidden and d_weight by the incoming gradient. A gradient
reaching the returned log-probs or entropy in backward (a further loss on them) raises
LossGradientError: it would otherwise be dropped silently. Where the chunks go, or that the call
takes the two-pass path instead, is chunking.py's.

Where the final evaluation runs on CUDA, so it overlaps the last chunk's GEMMs: the final evaluation (loss value,
metrics, separability check) is mostly host work with synchronizations (verl's ppo_loss has dozens). With
`host_loss_fn` it runs on pinned host copies of the final values, taken in stream order right after the last
chunk's statistics and ahead of its gradient GEMMs: nothing it does waits for the GPU. Otherwise loss_fn runs on a
high-priority CUDA stream that waits only for the last chunk's statistics. The host evaluation runs on one
intra-op thread: its tensors hold one value per token, where a team of OpenMP threads gains nothing and, when one
of its threads is descheduled, stalls a whole step (H200 host, 16 threads, 65536 rows: about one step in five
70-90 ms slower; none with one).

The two-pass path (`two_pass_loss`), for a call no chunk plan fits: a sequence longer than a chunk, or a GPU
short of memory for the smallest chunk, must not fail a job that the two-pass op would run. So the call takes the
two-pass op's passes on the problem it built (statistics now, logits recomputed in backward: four GEMMs), and
loss_fn is evaluated once on the final values, as the fused path's final evaluation: exact for any loss, no
per-chunk gradients, no separability to prove. The result keeps the fused path's contract: the loss
back-propagates (the loss's gradients in the log-probs and entropy, checked finite, scale the two-pass backward),
metrics are loss_fn's, and a gradient reaching the returned log-probs or entropy raises LossGradientError.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..checks import check_int
from .arguments import LogProbProblem, build_problem
from .backends import BlockBackend, LossInsidePasses, check_backend_name, resolve_backend
from .chunking import check_row_groups, log_fallback, plan_chunks, row_group_units
from .separability import (
    LossCall,
    LossFunction,
    RowGradients,
    check_finite,
    check_separable,
    chunk_row_gradients,
    evaluate,
    gradient_reached_outputs,
)
from .softmax_math import combine_row_statistics, no_column_partials
from .two_pass import run_passes
from .weight_gradient import WeightGradientSum, returned_weight_grad


@dataclass
class FusedLossResult:
    """loss: scalar, differentiable in hidden and weight; metrics: what loss_fn returned with it;
    log_probs, entropy: fp32 shaped like labels (entropy None unless asked); not to be differentiated."""

    loss: torch.Tensor
    metrics: Any
    log_probs: torch.Tensor
    entropy: torch.Tensor | None


class LossPass(NamedTuple):
    """What one path of the call computed: the loss and its metrics, fp32 log-probs and entropy (None unless asked)
    over every row [N], and the input gradients where the pass computed them in its forward (the fused path)."""

    loss: torch.Tensor
    metrics: Any
    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    d_hidden: torch.Tensor | None = None
    d_weight: torch.Tensor | None = None


class HostCopy:
    """Host copies of the final values, enqueued on the current stream: pinned buffers the copy engine fills
    while the GEMMs queued after them run; `values()` waits for that copy only. Off CUDA the tensors are
    already on the host."""

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


def evaluate_on_host(call: LossCall, copy: HostCopy, device: torch.device):
    """host_loss_fn's final evaluation and the separability check, on the host copies; the loss back on `device`."""
    log_probs, entropy, g_lp_used, g_ent_used, active_rows = copy.values()
    with one_intra_op_thread():
        loss, metrics, g_lp_exact, g_ent_exact = evaluate(call, log_probs, entropy, True, loss_fn=call.host_loss_fn)
        check_separable(call, g_lp_used, g_lp_exact, active_rows, "log-prob")
        if g_ent_used is not None:
            check_separable(call, g_ent_used, g_ent_exact, active_rows, "entropy")
    if device.type == "cuda":
        return loss.pin_memory().to(device, non_blocking=True), metrics
    return loss, metrics


@contextlib.contextmanager
def one_intra_op_thread():
    """torch's intra-op threads set to one inside, restored after (also when the loss raises). The setting is the
    process's: CPU ops of other threads in it run single-threaded for those milliseconds too."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def evaluation_stream(device: torch.device) -> torch.cuda.Stream:
    """One high-priority stream per device for loss_fn's final evaluation (its kernels go first when SMs free up).
    Reused by every call: each use first waits for the main stream, so blocks it frees are safe to reuse."""
    return torch.cuda.Stream(device, priority=-100)


def _one_pass(
    p: LogProbProblem,
    call: LossCall,
    want_grads: bool,
    passes: LossInsidePasses,
    accumulator: torch.Tensor | None = None,
) -> LossPass:
    """Chunk by chunk: logits once, statistics, the loss's row gradients, d_logits, both input gradients
    (`accumulator`: the fp32 d_weight sum's buffer, from `_workspace`)."""
    device, n = p.hidden.device, p.num_rows
    log_probs = torch.zeros(n, dtype=torch.float32, device=device)
    entropy = torch.zeros(n, dtype=torch.float32, device=device) if p.calculate_entropy else None
    g_lp_used = torch.zeros(n, dtype=torch.float32, device=device) if want_grads else None
    g_ent_used = torch.zeros(n, dtype=torch.float32, device=device) if want_grads and p.calculate_entropy else None
    d_hidden = torch.zeros_like(p.hidden) if want_grads else None
    d_weight = weight_sum = None
    if want_grads:
        d_weight = torch.empty_like(p.weight)
        d_weight[p.valid_columns :].zero_()
        weight_sum = WeightGradientSum(d_weight[: p.valid_columns], passes.block_count, accumulator)
    # The final evaluation should overlap the last chunk's gradient GEMMs (module docstring): on host copies
    # taken ahead of those GEMMs with host_loss_fn, else (CUDA, where the backend's GEMMs leave room for it) on
    # a high-priority stream that waits only for the last chunk's statistics.
    host = call.host_loss_fn is not None and want_grads
    host_copy = evaluation = main = None
    if want_grads and not host and passes.overlap_final_evaluation and device.type == "cuda":
        evaluation = evaluation_stream(device)
        main = torch.cuda.current_stream(device)
    for block in passes.blocks():
        rows, last = block.rows, block.span.stop == p.active_rows.numel()
        if p.valid_columns > 0:
            partials = passes.statistics(block)
        else:  # a shard of padding only: no mass, still part of the TP merge
            partials = no_column_partials(rows.numel(), device)
        statistics = combine_row_statistics(p, partials)
        log_probs.index_copy_(0, rows, statistics.log_probs)
        if entropy is not None:
            entropy.index_copy_(0, rows, statistics.entropy)
        if not want_grads:
            continue
        g_lp, g_ent = chunk_row_gradients(call, rows, log_probs, entropy, statistics.log_probs, statistics.entropy)
        g_lp_used.index_copy_(0, rows, g_lp)
        if g_ent_used is not None:
            g_ent_used.index_copy_(0, rows, g_ent)
        if host and last:
            host_copy = HostCopy(log_probs, entropy, g_lp_used, g_ent_used, p.active_rows)
        if p.valid_columns == 0:
            continue
        if evaluation is not None and last:
            evaluation.wait_stream(main)
        chunk_d_hidden = passes.gradients(block, statistics.gradient_inputs(g_lp, g_ent), True, weight_sum)
        d_hidden.index_copy_(0, rows, chunk_d_hidden.to(d_hidden.dtype))  # portable passes: fp32 for bf16/fp16 inputs
    if want_grads:
        weight_sum.finish()
    if host_copy is not None:
        loss, metrics = evaluate_on_host(call, host_copy, device)
        return LossPass(loss, metrics, log_probs, entropy, d_hidden, d_weight)
    with contextlib.ExitStack() as on_evaluation_stream:
        if evaluation is not None:
            on_evaluation_stream.enter_context(torch.cuda.stream(evaluation))
        try:
            loss, metrics, g_lp_exact, g_ent_exact = evaluate(call, log_probs, entropy, with_grad=want_grads)
            if want_grads:
                check_separable(call, g_lp_used, g_lp_exact, p.active_rows, "log-prob")
                if g_ent_used is not None:
                    check_separable(call, g_ent_used, g_ent_exact, p.active_rows, "entropy")
        finally:
            if evaluation is not None:  # what it computed is used on the main stream from here on
                main.wait_stream(evaluation)
    return LossPass(loss, metrics, log_probs, entropy, d_hidden, d_weight)


def _workspace(p: LogProbProblem, module: BlockBackend, spans: list[slice], loss_name: str):
    """(the backend's passes with their buffer of kept logits, the fp32 d_weight accumulator or None), allocated
    before any work; None, with a warning, when the allocator cannot give them (the free memory counted was there,
    in pieces too small): the call then takes the two-pass path instead of running out of memory halfway. Under
    tensor parallelism every rank takes the same path (their collectives differ): one MIN all-reduce agrees."""
    passes = accumulator = failure = None
    try:
        passes = module.loss_inside_passes(p, True, spans)
        if passes.block_count > 1 and p.weight.dtype != torch.float32:
            accumulator = torch.empty(p.valid_columns, p.weight.shape[1], dtype=torch.float32, device=p.weight.device)
    except torch.OutOfMemoryError as error:
        passes = accumulator = None
        failure = " ".join(str(error).split())[:240]
    if p.tp_world_size > 1:
        allocated = torch.tensor([int(failure is None)], dtype=torch.int64, device=p.hidden.device)
        dist.all_reduce(allocated, op=dist.ReduceOp.MIN, group=p.tp_group)
        if failure is None and not allocated.item():
            passes = accumulator = None
            failure = "another rank of tp_group could not allocate its own"
    if failure is None:
        return passes, accumulator
    log_fallback(
        loss_name,
        "allocation",
        (
            f"log_probs_entropy_and_loss: loss {loss_name}: the chunk of kept logits or the fp32 d_weight accumulator "
            f"could not be allocated ({failure}); this call runs the two-pass path (logits recomputed in backward)"
        ),
    )
    return None


def _scaled(gradient: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`gradient` (this call's own buffer) times d(result)/d(loss), in place: megatron's schedule scales the loss
    (by the CP size, an fp16 loss scale, 1/micro-batches), and an fp32 copy would add 6 bytes an element at the
    start of the backward (4.6 GiB for a 151936 x 4096 d_weight). A Python float factor makes the multiply fp32
    on 16-bit values, rounded once."""
    factor = float(scale)
    if factor != 1.0:
        gradient.mul_(factor)
    return gradient


class _FusedLogProbEntropyLoss(torch.autograd.Function):
    """Forward does all the work; backward scales the stored input gradients by d(result)/d(loss)."""

    @staticmethod
    def forward(ctx, hidden, weight, p: LogProbProblem, call: LossCall, workspace):
        result = _one_pass(p, call, True, *workspace)
        call.metrics = result.metrics
        ctx.d_hidden, ctx.d_weight, ctx.loss_name = result.d_hidden, result.d_weight, call.loss_name
        ctx.main_grad_owner = weight if p.main_grad_dtype is not None else None
        ctx.set_materialize_grads(False)
        entropy = result.entropy if result.entropy is not None else torch.zeros_like(result.log_probs)
        return result.loss, result.log_probs, entropy

    @staticmethod
    @once_differentiable  # second-order gradients are not implemented: raise, never return wrong ones
    def backward(ctx, grad_loss, grad_log_probs, grad_entropy):
        for name, grad in (("log-probs", grad_log_probs), ("entropy", grad_entropy)):
            if grad is not None and bool(grad.ne(0).any()):
                raise gradient_reached_outputs(ctx.loss_name, name)
        if grad_loss is None:
            return None, None, None, None, None
        grad_hidden = _scaled(ctx.d_hidden, grad_loss) if ctx.needs_input_grad[0] else None
        owner, ctx.main_grad_owner = ctx.main_grad_owner, None
        if owner is not None:  # one rounding, into main_grad's own dtype
            owner.main_grad.add_(ctx.d_weight, alpha=float(grad_loss))
            grad_weight = returned_weight_grad(owner)
        else:
            grad_weight = _scaled(ctx.d_weight, grad_loss) if ctx.needs_input_grad[1] else None
        ctx.d_hidden = ctx.d_weight = None
        return grad_hidden, grad_weight, None, None, None


class _LinearizedLoss(torch.autograd.Function):
    """The loss's value; backward hands grad * (d loss / d log_probs, d loss / d entropy) to the two-pass op."""

    @staticmethod
    def forward(ctx, loss, log_probs, entropy, g_lp, g_ent):
        ctx.g_lp, ctx.g_ent = g_lp, g_ent
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        def scaled(g):
            return None if g is None else (g if bool(grad == 1) else g * grad)

        return None, scaled(ctx.g_lp), scaled(ctx.g_ent), None, None


class _RefuseGradient(torch.autograd.Function):
    """Identity on the returned log-probs or entropy; a nonzero gradient reaching them raises, as on the fused path."""

    @staticmethod
    def forward(ctx, values, loss_name, what):
        ctx.loss_name, ctx.what = loss_name, what
        ctx.set_materialize_grads(False)
        return values.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if grad is not None and bool(grad.ne(0).any()):
            raise gradient_reached_outputs(ctx.loss_name, ctx.what)
        return None, None, None


def two_pass_loss(p: LogProbProblem, call: LossCall, module: BlockBackend) -> LossPass:
    """The call through `module`'s two-pass passes (see the module docstring)."""
    log_probs, entropy = run_passes(p, module)
    if not p.needs_grad:
        loss, metrics, _, _ = evaluate(call, log_probs, entropy, with_grad=False)
        return LossPass(loss, metrics, log_probs, entropy)
    loss, metrics, g_lp, g_ent = evaluate(call, log_probs.detach(), None if entropy is None else entropy.detach(), True)
    rows = p.active_rows
    check_finite(call, g_lp.index_select(0, rows), rows, "log-prob", "autograd of the loss")
    if g_ent is not None:
        check_finite(call, g_ent.index_select(0, rows), rows, "entropy", "autograd of the loss")
    loss = _LinearizedLoss.apply(loss, log_probs, entropy, g_lp, g_ent)
    log_probs = _RefuseGradient.apply(log_probs, call.loss_name, "log-probs")
    if entropy is not None:
        entropy = _RefuseGradient.apply(entropy, call.loss_name, "entropy")
    return LossPass(loss, metrics, log_probs, entropy)


def log_probs_entropy_and_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    loss_fn: LossFunction,
    loss_name: str,
    temperature: float | torch.Tensor = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    tp_hidden: str = "replicated",
    score_mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    vocab_size: int | None = None,
    calculate_entropy: bool = True,
    backend: str = "auto",
    chunk_rows: int | None = None,
    row_gradients: RowGradients | None = None,
    host_loss_fn: LossFunction | None = None,
    chunk_bytes: int | None = None,
    row_groups: torch.Tensor | None = None,
    gradient_accumulation_fusion: bool = False,
    batch_invariant: bool = False,
) -> FusedLossResult:
    """`loss_fn(log_probs, entropy)` of `log_probs_and_entropy`'s outputs, its gradient computed in the same pass.

    Arguments as `log_probs_and_entropy` (same checks, same `tp_hidden` layouts), plus:
        loss_fn: (log_probs, entropy or None), fp32 shaped like labels -> (scalar loss, metrics). Must be
            token-separable (row i's gradient depends on row i's values only) and deterministic; it is
            called once per chunk of rows and once more on the final values, identically on every TP rank.
        loss_name: names the loss in errors.
        backend: as `log_probs_and_entropy`'s, except "verl" (its kernel leaves no room for a loss):
            "auto" takes Triton's passes (logits kept in fp16) where the Triton backend runs, else the
            portable fp32 passes, with a warning once per reason on CUDA.
        chunk_rows: scored rows per chunk (default: a chunk of logits near the backend's budget,
            triton_backend.STORED_CHUNK_BUDGET_BYTES or torch_backend.PORTABLE_CHUNK_BUDGET_BYTES; every
            scored row in one chunk where that costs no more than a budget chunk plus the fp32 d_weight
            accumulator). On CUDA never more than the free memory holds (chunking.plan_chunks); when not even
            a smallest chunk fits, the call takes the two-pass path, with a warning.
        row_gradients: optional (rows, their log_probs, their entropy or None) -> (g_lp, g_ent or None),
            the loss's gradients for the given flat rows; spares a whole-batch loss_fn call per chunk.
            Checked like the separability: against autograd of loss_fn after the last chunk.
        host_loss_fn: optional, the same loss over host (CPU) tensors: its captured data on the host. When
            gradients are computed, the final evaluation (loss value, metrics, separability check) calls it
            on host copies of the final log-probs and entropy, taken ahead of the last chunk's gradient
            GEMMs, so none of its synchronizations waits for them; the loss comes back on hidden's device.
            Its gradients are checked against those used, like row_gradients.
        chunk_bytes: the chunk budget in bytes, in place of the backend's (ignored when chunk_rows is given).
        row_groups: optional integer tensor shaped like labels, each row's group (sequence) id, negative for
            none: chunk boundaries fall between groups, so the loss's row gradients see every scored row of
            their group (sequence-level losses: GSPO, geo_mean). A group's scored rows must be contiguous in
            flattened labels order (ValueError naming row_groups), identical on every TP rank (checked). A
            group longer than a chunk sends the call to the two-pass path, with a warning.
        gradient_accumulation_fusion: True: the loss's backward adds d_weight (scaled) into `weight.main_grad`
            and returns Megatron's placeholder, as `log_probs_and_entropy`'s does. d_weight is computed in the
            forward, before that scale is known, so its buffer is kept as without it.
        batch_invariant: the log-probs, entropy (and so the ratio the loss clips) of a row the same bits
            whatever batch or chunk plan computes them, as `log_probs_and_entropy`'s.

    Returns FusedLossResult: `loss` back-propagates into hidden and weight (d_hidden as `tp_hidden` says);
    `metrics` come from the final evaluation. Backward raises LossGradientError if a gradient reaches the
    returned log_probs/entropy; the forward raises NonSeparableLossError when loss_fn is not
    token-separable (per chunk, or per row group), NonFiniteLossGradientError when its gradient at a scored
    row is NaN or infinite. On the two-pass path (`two_pass_loss`) the same holds except that any loss is exact
    and row_gradients and host_loss_fn are not called.
    """
    if not callable(loss_fn):
        raise ValueError(
            f"loss_fn: expected a callable (log_probs, entropy) -> (loss, metrics), got {type(loss_fn).__name__}"
        )
    if not isinstance(loss_name, str) or not loss_name:
        raise ValueError(f"loss_name: expected a non-empty str, got {loss_name!r}")
    for name, value in (("row_gradients", row_gradients), ("host_loss_fn", host_loss_fn)):
        if value is not None and not callable(value):
            raise ValueError(f"{name}: expected None or a callable, got {type(value).__name__}")
    check_int("chunk_bytes", chunk_bytes, low=1, optional=True, expected="expected None or an int >= 1 (bytes)")
    check_backend_name(backend)
    check_row_groups(row_groups, labels)
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
        tp_hidden=tp_hidden,
        gradient_accumulation_fusion=gradient_accumulation_fusion,
        batch_invariant=batch_invariant,
    )
    call = LossCall(
        loss_fn=loss_fn,
        loss_name=loss_name,
        shape=labels.shape,
        row_gradients=row_gradients,
        host_loss_fn=host_loss_fn,
        grouped=row_groups is not None,
    )
    # fp32 whatever the caller's autocast says, as log_probs_and_entropy (its backward only scales)
    with torch.autocast(device_type=p.hidden.device.type, enabled=False):
        module = resolve_backend(backend, p, driver="log_probs_entropy_and_loss").load()
        groups = None if row_groups is None else row_group_units(row_groups, p)
        spans = plan_chunks(
            p,
            module.loss_inside_cost(p, p.needs_grad),
            want_grads=p.needs_grad,
            chunk_rows=chunk_rows,
            chunk_bytes=chunk_bytes,
            groups=groups,
            loss_name=loss_name,
        )

        workspace = _workspace(p, module, spans, loss_name) if spans is not None and p.needs_grad else None
        if spans is None or (p.needs_grad and workspace is None):
            result = two_pass_loss(p, call, module)
        elif not p.needs_grad:
            with torch.no_grad():
                result = _one_pass(p, call, False, module.loss_inside_passes(p, False, spans))
        else:
            loss, log_probs, entropy = _FusedLogProbEntropyLoss.apply(p.hidden, p.weight, p, call, workspace)
            result = LossPass(loss, call.metrics, log_probs, entropy if p.calculate_entropy else None)
    return FusedLossResult(
        loss=result.loss,
        metrics=result.metrics,
        log_probs=result.log_probs.view(labels.shape),
        entropy=None if result.entropy is None else result.entropy.view(labels.shape),
    )
