"""The op's softmax math in torch, written once: every backend and both drivers use it.

Conventions, shared with the Triton kernels: a block's raw logits `raw = h @ W_local[:valid].T`
are fp32 and `z = raw * inv_temp` per row. Everything is taken relative to the row max m,
which keeps the entropy exact for logits of any magnitude. A *partial* holds, per row and
over some subset of columns (a tile, a vocabulary split, a rank's shard): the max m, the sum
s = sum_j e^(z_j - m), the shifted dot d = sum_j e^(z_j - m)(z_j - m) and the label logit z_y
(0 where the label is not in the subset). Named tuples carry what passes between the backends' blocks and the
drivers: `Partials` (a block's statistics), `RowStatistics` (merged over the vocabulary), `LogitGradientInputs`
(what a block's d_logits is formed from).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from .arguments import LogProbProblem


class Partials(NamedTuple):
    """A partial per row over some subset of columns, fp32 [R] each (see the module docstring)."""

    row_max: Tensor
    sum_exp: Tensor
    shifted_dot: Tensor
    label_logit: Tensor


class LogitGradientInputs(NamedTuple):
    """What a block's d_logits is formed from, fp32 [R] each: the merged (whole vocabulary) statistics of its rows,
    and the upstream gradients of their log-probs and entropy (None: that gradient is absent)."""

    row_max: Tensor
    log_sum: Tensor
    shifted_mean: Tensor
    g_lp: Tensor | None
    g_ent: Tensor | None


class RowStatistics(NamedTuple):
    """Partials merged over every rank's shard, fp32 [R] each: the outputs (entropy None unless asked) and what
    the gradients are taken against: the row max, log sum e^(z - max) and shifted mean E[z] - max."""

    log_probs: Tensor
    entropy: Tensor | None
    row_max: Tensor
    log_sum: Tensor
    shifted_mean: Tensor

    def gradient_inputs(self, g_lp: Tensor | None, g_ent: Tensor | None) -> LogitGradientInputs:
        return LogitGradientInputs(self.row_max, self.log_sum, self.shifted_mean, g_lp, g_ent)


def label_columns(p: LogProbProblem, rows: Tensor) -> Tensor:
    """int64 [R]: each row's label column in this rank's shard, -1 where another rank (or no column) holds it."""
    local = p.labels.index_select(0, rows) - p.vocab_start
    return torch.where((local >= 0) & (local < p.valid_columns), local, -1)


def inverse_temperature(temperature: float | Tensor, rows: Tensor) -> Tensor:
    """fp32 [R]: 1 / temperature of each row."""
    if isinstance(temperature, Tensor):
        return temperature.index_select(0, rows).reciprocal()
    return torch.full((rows.numel(),), 1.0 / temperature, dtype=torch.float32, device=rows.device)


def no_column_partials(count: int, device: torch.device) -> Partials:
    """The partial of a shard without columns (padding only): no mass, still part of the TP merge."""
    zeros = torch.zeros(count, dtype=torch.float32, device=device)
    return Partials(torch.full_like(zeros, float("-inf")), zeros, zeros, zeros)


def partial_statistics(raw: Tensor, label_col: Tensor, inv_temp: Tensor, *, entropy: bool, keep_raw: bool) -> Partials:
    """The partial of fp32 raw logits [R, C]. keep_raw=False works in place over `raw` (no second
    [R, C] temporary beyond e^(z - m)); the shifted dot is 0 unless `entropy`."""
    z = raw * inv_temp.unsqueeze(1) if keep_raw else raw.mul_(inv_temp.unsqueeze(1))
    picked = z.gather(1, label_col.clamp_min(0).unsqueeze(1)).squeeze(1)
    label_logit = torch.where(label_col >= 0, picked, torch.zeros_like(picked))
    row_max = z.amax(dim=1)
    shifted = z.sub_(row_max.unsqueeze(1))
    exp_shifted = shifted.exp()
    sum_exp = exp_shifted.sum(dim=1)
    # in place: no third [R, C] temporary; sum() reduces pairwise, unlike a dot product
    shifted_dot = exp_shifted.mul_(shifted).sum(dim=1) if entropy else torch.zeros_like(sum_exp)
    return Partials(row_max, sum_exp, shifted_dot, label_logit)


def rescale_partials(global_max, local_max, local_sum, local_shifted_dot):
    """A partial's (sum, shifted dot) re-expressed relative to `global_max` (>= its own max); partials
    without mass (no columns) give 0. Summing the results over partials merges them exactly."""
    has_mass = local_sum > 0
    safe_local_max = torch.where(has_mass, local_max, global_max)
    rescale = torch.where(has_mass, torch.exp(safe_local_max - global_max), torch.zeros_like(local_sum))
    # sum_j e^(z_j - M) (z_j - M) = rescale * (sum_j e^(z_j - m) (z_j - m) + (m - M) * sum_j e^(z_j - m))
    return local_sum * rescale, rescale * (local_shifted_dot + (safe_local_max - global_max) * local_sum)


def merge_partials(part_max: Tensor, part_sum: Tensor, part_dot: Tensor, part_label: Tensor) -> Partials:
    """One partial per row from [splits, R] partials over disjoint column subsets."""
    row_max = part_max.amax(dim=0)
    total, dot = rescale_partials(row_max, part_max, part_sum, part_dot)
    return Partials(row_max, total.sum(dim=0), dot.sum(dim=0), part_label.sum(dim=0))


def combine_row_statistics(p: LogProbProblem, partials: Partials) -> RowStatistics:
    """Merge this rank's partials with the other ranks' (one MAX and one SUM all-reduce), over the same rows.

    When `p.label_is_max` is a buffer (the rows are then all of p.active_rows), also record whether
    each row's label logit equals the row max: the label logit is one rank's value plus exact zeros
    and the max a MAX all-reduce of values rounded the same way, so the comparison is exact (a tie
    counts as True)."""
    local_max, local_sum, local_shifted_dot, label_logit = partials
    global_max = local_max.clone()
    if p.tp_world_size > 1:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=p.tp_group)
    scaled_sum, shifted_dot = rescale_partials(global_max, local_max, local_sum, local_shifted_dot)
    sums = torch.stack([scaled_sum, shifted_dot, label_logit])
    if p.tp_world_size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=p.tp_group)
    total, total_dot, label = sums.unbind(0)
    if p.label_is_max is not None:
        p.label_is_max.index_copy_(0, p.active_rows, label >= global_max)
    log_sum = total.log()
    shifted_mean = total_dot / total
    log_probs = label - global_max - log_sum
    entropy = log_sum - shifted_mean if p.calculate_entropy else None
    return RowStatistics(log_probs, entropy, global_max, log_sum, shifted_mean)


def scatter_rows(p: LogProbProblem, values: Tensor | None) -> Tensor | None:
    """Full-length fp32 [N] tensor holding `values` at the scored rows and 0 elsewhere."""
    if values is None:
        return None
    out = torch.zeros(p.num_rows, dtype=torch.float32, device=p.hidden.device)
    return out.index_copy_(0, p.active_rows, values)


def grad_logits(raw: Tensor, label_col: Tensor, inv_temp: Tensor, inputs: LogitGradientInputs) -> Tensor:
    """fp32 [R, C] gradient of sum_i g_lp_i log p_i + g_ent_i H_i with respect to the raw logits,
    formed in place over `raw`: dz_j = inv_temp * (g_lp ([j == y] - p_j) + g_ent p_j (E[z] - z_j)).
    """
    row_max, log_sum, shifted_mean, g_lp, g_ent = inputs
    inv = inv_temp.unsqueeze(1)
    shifted = raw.mul_(inv).sub_(row_max.unsqueeze(1))
    probs = (shifted - log_sum.unsqueeze(1)).exp_()
    # g_ent (E[z] - z_j) - g_lp, built in place in `shifted`, then times p_j
    grad = shifted
    if g_ent is not None:
        grad.neg_().add_(shifted_mean.unsqueeze(1)).mul_(g_ent.unsqueeze(1))
    else:
        grad.zero_()
    if g_lp is not None:
        grad.sub_(g_lp.unsqueeze(1))
    grad.mul_(probs)
    del probs
    if g_lp is not None:
        grad.scatter_add_(1, label_col.clamp_min(0).unsqueeze(1), (g_lp * (label_col >= 0)).unsqueeze(1))
    return grad.mul_(inv)
