"""The bench's distillation methods (issue 43): verl's forward_kl_topk on the output layer, forward and backward, and
sum pi^2 in a forward step.

kl_topk: `token_log_probs` at the teacher's top-k ids (two passes, no logits) and the row's own top-k for verl's
overlap metrics, then verl's per-token loss on those log-probs. verl_kl_topk: verl's path as its Megatron engine
runs it: bf16 logits of the output layer divided by T, verl's `_VocabParallelKLDivergence` forward and backward (its
megatron parallel state at TP=1). verl_kl_topk_chunked: verl's `use_chunked_topk` path (it lives in verl's FSDP
losses, `compute_forward_kl_topk`; the Megatron engine has none) on the same bf16 logits. sum_pi_squared: our
log-probs, entropy and sum pi^2 in one call, compared with one GEMM in the forward-only table.

Every method here returns the summed per-token loss (a scalar, `returns_loss`) and carries `accuracy`: its loss and
gradients against fp64 logits and the same loss. The teacher's ids and log-probs are synthetic, made once per shape
(random ids, duplicates possible; log-probs of a softmax over k with 0.9 of the mass), and count as inputs.
"""

from __future__ import annotations

import functools
import math
import types

import torch

from verl_fused_hook.ops import token_log_probs

from ...support.compare import relative_scalar
from ...support.reference import loss_reference, relative_error

# verl's DistillationLossConfig.log_prob_min_clamp default.
LOG_PROB_MIN_CLAMP = -10.0


@functools.lru_cache(maxsize=1)
def teacher_top_k(n: int, vocab: int, k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 ids [n, k], fp32 log-probs [n, k]) of a synthetic teacher."""
    g = torch.Generator(device=device).manual_seed(n * 31 + k)
    ids = torch.randint(0, vocab, (n, k), device=device, generator=g)
    log_probs = torch.log_softmax(2 * torch.randn(n, k, device=device, generator=g), dim=-1) + math.log(0.9)
    return ids, log_probs


def forward_kl_topk(
    student_log_probs: torch.Tensor, teacher_log_probs: torch.Tensor, clamp: float | None
) -> torch.Tensor:
    """verl's per-token forward KL over the teacher's top-k: sum_j q_j (log q_j - max(log p_j, clamp)), q from the
    clamped teacher log-probs (gradient m_A p - q 1[A], A the ids whose log p is above the clamp)."""
    if clamp is not None:
        teacher_log_probs = teacher_log_probs.clamp_min(clamp)
        student_log_probs = student_log_probs.clamp_min(clamp)
    return (teacher_log_probs.exp() * (teacher_log_probs - student_log_probs)).sum(-1)


def overlap_metrics(teacher_ids: torch.Tensor, student_top_ids: torch.Tensor, token_kl: torch.Tensor):
    """verl's overlap_count and overlap_token_advantage (no gradient) from a row's top ids, by sorted search instead
    of verl's [N, k, k] comparison: per row, which teacher ids are among the student's top ids."""
    with torch.no_grad():
        sorted_ids = student_top_ids.sort(dim=-1).values
        found = torch.searchsorted(sorted_ids, teacher_ids).clamp_max(sorted_ids.shape[-1] - 1)
        overlap = sorted_ids.gather(-1, found) == teacher_ids
        count = overlap.sum(-1)
        advantage = (-token_kl * overlap).sum(-1) / count.clamp_min(1)
        return count, torch.where(count > 0, advantage, torch.zeros_like(advantage))


def _with_accuracy(fn, k: int, clamp: float | None):
    fn.returns_loss = True
    fn.accuracy = functools.partial(kl_accuracy, fn, k, clamp)
    return fn


def ours_kl_topk(
    k: int, clamp: float | None = LOG_PROB_MIN_CLAMP, backend: str = "auto", chunk_bytes: int | None = None
):
    """`chunk_bytes`: token_log_probs' top_k_chunk_bytes (None: its default)."""

    def fn(h, w, labels, temperature, score_mask=None):
        ids, teacher = teacher_top_k(h.shape[0], w.shape[0], k, str(h.device))
        out = token_log_probs(
            h,
            w,
            labels,
            ids,
            temperature=temperature,
            score_mask=score_mask,
            calculate_log_probs=False,
            calculate_entropy=False,
            top_k=k,
            top_k_chunk_bytes=chunk_bytes,
            backend=backend,
        )
        per_token = forward_kl_topk(out.token_log_probs, teacher, clamp)
        overlap_metrics(ids, out.top_ids, teacher.clamp_min(clamp).exp() * (teacher - out.token_log_probs))
        return per_token.sum()

    return _with_accuracy(fn, k, clamp)


def _megatron_tp1(device: str) -> None:
    """verl's megatron loss reads megatron's parallel state: one rank, TP=1 (set up once)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        from ...support.distributed import init_single_process

        init_single_process(device, seed=0)


def _bf16_logits(h, w, temperature):
    """The output layer's logits as verl's engine hands them to its loss: in the weight's dtype, divided by T."""
    return (h @ w.t()) / temperature


def verl_kl_topk(k: int, clamp: float | None = LOG_PROB_MIN_CLAMP):
    """verl's _VocabParallelKLDivergence on full logits; a string (why not) without verl."""
    try:
        from verl.trainer.distillation.megatron.losses import _VocabParallelKLDivergence
    except ImportError as error:
        return f"verl's megatron distillation loss cannot be imported ({error})"
    _megatron_tp1("cuda" if torch.cuda.is_available() else "cpu")

    def fn(h, w, labels, temperature, score_mask=None):
        ids, teacher = teacher_top_k(h.shape[0], w.shape[0], k, str(h.device))
        per_token = _VocabParallelKLDivergence.apply(_bf16_logits(h, w, temperature), teacher, ids, clamp)[0]
        return per_token.sum()

    return _with_accuracy(fn, k, clamp)


def verl_kl_topk_chunked(k: int, clamp: float | None = LOG_PROB_MIN_CLAMP):
    """verl's compute_forward_kl_topk with use_chunked_topk (its FSDP losses) on full logits."""
    try:
        from verl.trainer.distillation.fsdp.losses import compute_forward_kl_topk
        from verl.workers.config import DistillationLossConfig
    except ImportError as error:
        return f"verl's FSDP distillation loss cannot be imported ({error})"
    config = types.SimpleNamespace(
        distillation_loss=DistillationLossConfig(
            loss_mode="forward_kl_topk", topk=k, use_chunked_topk=True, log_prob_min_clamp=clamp
        )
    )

    def nested(t):  # verl's batches hold the teacher's outputs as jagged tensors
        return torch.nested.as_nested_tensor([t], layout=torch.jagged)

    def fn(h, w, labels, temperature, score_mask=None):
        ids, teacher = teacher_top_k(h.shape[0], w.shape[0], k, str(h.device))
        logits = _bf16_logits(h, w, temperature).unsqueeze(0)
        return compute_forward_kl_topk(logits, nested(teacher), nested(ids), config, "thd")["distillation_losses"].sum()

    return _with_accuracy(fn, k, clamp)


def ours_sum_pi_squared(backend: str = "auto"):
    """log-probs, entropy and sum pi^2 in one call (what the Optimal Token Baseline's forward needs)."""

    def fn(h, w, labels, temperature, score_mask=None):
        out = token_log_probs(
            h, w, labels, temperature=temperature, score_mask=score_mask, calculate_sum_pi_squared=True, backend=backend
        )
        return out.log_probs, out.entropy

    return fn


def kl_accuracy(fn, k: int, clamp: float | None, hidden, weight, labels, temperature) -> dict:
    """Relative error of a method's summed loss and both gradients against fp64 logits and the same loss."""
    ids, teacher = teacher_top_k(hidden.shape[0], weight.shape[0], k, str(hidden.device))
    want, want_dh, want_dw = loss_reference(
        hidden, weight, ids, lambda lp, _: forward_kl_topk(lp, teacher.double(), clamp).sum(), temperature=temperature
    )
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = fn(h, w, labels, temperature, None)
    dh, dw = torch.autograd.grad(loss, (h, w))
    return {
        "log_prob_max_err": None,
        "entropy_max_err": None,
        "loss_rel_err": relative_scalar(want.item(), loss.item()),
        "d_hidden_rel_err": relative_error(dh, want_dh),
        "d_weight_rel_err": relative_error(dw, want_dw),
    }


def loaders(k: int, chunk_bytes: int | None = None) -> dict:
    """The bench's distillation methods at top-k `k`, by name (`chunk_bytes`: our top-k's chunk budget)."""
    return {
        "kl_topk": lambda: ours_kl_topk(k, chunk_bytes=chunk_bytes),
        "verl_kl_topk": lambda: verl_kl_topk(k),
        "verl_kl_topk_chunked": lambda: verl_kl_topk_chunked(k),
        "sum_pi_squared": ours_sum_pi_squared,
    }
