"""Portable backend: tiled pure-PyTorch log-probs and entropy with a recomputing backward.

Rows go through in tiles of `tile_rows`; each tile's fp32 logits live only while
that tile is processed. The forward keeps three fp32 numbers per scored row
(row max, log of the shifted sum-exp, shifted mean logit); the backward
recomputes a tile's logits from them. Across tensor-parallel ranks only these
per-row statistics travel: one MAX and one SUM all-reduce per call.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .precision import fp32_backward
from .problem import LogProbProblem
from .statistics import combine_row_statistics, scatter_rows


def _row_temperature(temperature: float | torch.Tensor, rows: torch.Tensor) -> float | torch.Tensor:
    if isinstance(temperature, torch.Tensor):
        return temperature.index_select(0, rows).unsqueeze(1)
    return temperature


class _Gemms:
    """How a tile's products run. bf16/fp16 on CUDA: tensor-core GEMMs that accumulate and
    return fp32 (`out_dtype`), with d_logits rounded to the input dtype for the two backward
    products, as the Triton backend and verl's kernel do. Everywhere else (CPU, fp32): fp32
    operands throughout (an fp32 copy of a low-precision weight shard), exact to fp32 rounding."""

    def __init__(self, weight: torch.Tensor, valid_columns: int):
        self.mixed = weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)
        self.weight = weight[:valid_columns] if self.mixed else weight[:valid_columns].float()

    def rows(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        selected = hidden.index_select(0, rows)
        return selected if self.mixed else selected.float()

    def raw_logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 h @ W.T, before any temperature."""
        if self.mixed:
            return torch.mm(h, self.weight.t(), out_dtype=torch.float32)
        return h @ self.weight.t()

    def logits(self, h: torch.Tensor, temperature) -> torch.Tensor:
        return self.raw_logits(h).div_(temperature)

    def grad_operand(self, grad_logits: torch.Tensor) -> torch.Tensor:
        return grad_logits.to(self.weight.dtype) if self.mixed else grad_logits

    def grad_hidden(self, grad_logits: torch.Tensor) -> torch.Tensor:
        if self.mixed:
            return torch.mm(grad_logits, self.weight, out_dtype=torch.float32)
        return grad_logits @ self.weight

    def accumulate_grad_weight(self, accumulator: torch.Tensor, grad_logits: torch.Tensor, h: torch.Tensor) -> None:
        if self.mixed:
            torch.addmm(accumulator, grad_logits.t(), h, out_dtype=torch.float32, out=accumulator)
        else:
            accumulator.addmm_(grad_logits.t(), h)


def _local_columns(labels: torch.Tensor, rows: torch.Tensor, vocab_start: int, valid_columns: int):
    local = labels.index_select(0, rows) - vocab_start
    in_shard = (local >= 0) & (local < valid_columns)
    return local.clamp(0, max(valid_columns - 1, 0)), in_shard


def _forward_statistics(p: LogProbProblem, gemms: _Gemms):
    """Per scored row: global max, log sum-exp and mean logit (both shifted by the max), label logit."""
    n_active = p.active_rows.numel()
    device = p.hidden.device
    local_max = torch.full((n_active,), float("-inf"), device=device)
    local_sum = torch.zeros(n_active, device=device)
    local_shifted_dot = torch.zeros(n_active, device=device)
    label_logit = torch.zeros(n_active, device=device)
    if p.valid_columns > 0:
        for start in range(0, n_active, p.tile_rows):
            part = slice(start, min(start + p.tile_rows, n_active))
            rows = p.active_rows[part]
            logits = gemms.logits(gemms.rows(p.hidden, rows), _row_temperature(p.temperature, rows))
            column, in_shard = _local_columns(p.labels, rows, p.vocab_start, p.valid_columns)
            picked = logits.gather(1, column.unsqueeze(1)).squeeze(1)
            label_logit[part] = torch.where(in_shard, picked, torch.zeros_like(picked))
            row_max = logits.amax(dim=1)
            shifted = logits.sub_(row_max.unsqueeze(1))
            exp_shifted = shifted.exp()
            local_max[part] = row_max
            local_sum[part] = exp_shifted.sum(dim=1)
            if p.calculate_entropy:
                # in place: no third [rows, V] temporary; sum() reduces pairwise, unlike a dot product
                local_shifted_dot[part] = exp_shifted.mul_(shifted).sum(dim=1)
            del logits, shifted, exp_shifted
    return combine_row_statistics(p, local_max, local_sum, local_shifted_dot, label_logit)


class _TiledLogProbEntropy(torch.autograd.Function):
    """Autograd wrapper: saves inputs plus O(N) statistics, recomputes logits tile by tile in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, p: LogProbProblem):
        log_probs, entropy, row_max, log_sum, shifted_mean = _forward_statistics(p, _Gemms(weight, p.valid_columns))
        temperature = p.temperature if isinstance(p.temperature, torch.Tensor) else None
        ctx.save_for_backward(hidden, weight, p.labels, p.active_rows, row_max, log_sum, shifted_mean, temperature)
        ctx.scalar_temperature = None if temperature is not None else p.temperature
        ctx.layout = (p.vocab_start, p.valid_columns, p.tile_rows, p.calculate_entropy)
        ctx.set_materialize_grads(False)
        return scatter_rows(p, log_probs), scatter_rows(p, entropy)

    @staticmethod
    @once_differentiable  # second-order gradients are not implemented: raise, never return wrong ones
    @fp32_backward
    def backward(ctx, grad_log_probs, grad_entropy):
        hidden, weight, labels, active_rows, row_max, log_sum, shifted_mean, temperature = ctx.saved_tensors
        vocab_start, valid_columns, tile_rows, calculate_entropy = ctx.layout
        temperature = temperature if temperature is not None else ctx.scalar_temperature
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight32 = (
            torch.zeros(valid_columns, hidden.shape[1], dtype=torch.float32, device=hidden.device)
            if ctx.needs_input_grad[1]
            else None
        )
        if grad_entropy is None or not calculate_entropy:
            grad_entropy = None
        if valid_columns > 0 and (grad_log_probs is not None or grad_entropy is not None):
            gemms = _Gemms(weight, valid_columns)
            n_active = active_rows.numel()
            for start in range(0, n_active, tile_rows):
                part = slice(start, min(start + tile_rows, n_active))
                rows = active_rows[part]
                h = gemms.rows(hidden, rows)
                logits = gemms.logits(h, _row_temperature(temperature, rows))
                shifted = logits.sub_(row_max[part].unsqueeze(1))
                probs = (shifted - log_sum[part].unsqueeze(1)).exp_()
                # d_z = p * (g_H * (E[z] - z) - g_lp) + g_lp * onehot(y), built in place in `shifted`
                grad_logits = shifted
                if grad_entropy is not None:
                    g_entropy = grad_entropy.index_select(0, rows).float().unsqueeze(1)
                    grad_logits.neg_().add_(shifted_mean[part].unsqueeze(1)).mul_(g_entropy)
                else:
                    grad_logits.zero_()
                if grad_log_probs is not None:
                    g_log_probs = grad_log_probs.index_select(0, rows).float().unsqueeze(1)
                    grad_logits.sub_(g_log_probs)
                grad_logits.mul_(probs)
                del logits, shifted, probs
                if grad_log_probs is not None:
                    column, in_shard = _local_columns(labels, rows, vocab_start, valid_columns)
                    grad_logits.scatter_add_(1, column.unsqueeze(1), g_log_probs * in_shard.unsqueeze(1).float())
                grad_logits = gemms.grad_operand(grad_logits.div_(_row_temperature(temperature, rows)))
                if grad_hidden is not None:
                    grad_hidden.index_copy_(0, rows, gemms.grad_hidden(grad_logits).to(hidden.dtype))
                if grad_weight32 is not None:
                    gemms.accumulate_grad_weight(grad_weight32, grad_logits, h)
        grad_weight = None
        if grad_weight32 is not None:
            grad_weight = torch.zeros_like(weight)
            grad_weight[:valid_columns] = grad_weight32.to(weight.dtype)
        return grad_hidden, grad_weight, None


def run(p: LogProbProblem) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs and entropy for `p`; differentiable in hidden and weight when they require grad."""
    if not p.needs_grad:
        with torch.no_grad():
            log_probs, entropy, *_ = _forward_statistics(p, _Gemms(p.weight, p.valid_columns))
        return scatter_rows(p, log_probs), scatter_rows(p, entropy)
    return _TiledLogProbEntropy.apply(p.hidden, p.weight, p)
