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
    if rows.numel() == p.num_rows and p.vocab_start == 0 and p.valid_columns == p.vocab_size:
        # every row scored and one shard holding the vocabulary: the labels are the columns (six fewer launches
        # before the kernel); build_problem checked each to lie in [0, vocab_size), or its pending check will, the
        # backends meanwhile finding no column for an id outside (ignore_index, say)
        return p.labels
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
    # a column past the shard only comes from labels whose check is still pending (arguments.PendingLabelCheck)
    picked = z.gather(1, label_col.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
    label_logit = torch.where((label_col >= 0) & (label_col < z.shape[1]), picked, torch.zeros_like(picked))
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


def ordered_sum(values: Tensor) -> Tensor:
    """Sum over dim 0 of [S, R] in a fixed pairwise order that depends on S alone: (v0 + v1) + (v2 + v3), ...

    Why not `values.sum(dim=0)`: torch picks a reduction strategy by shape (on CUDA, how many threads and blocks
    share one output; on the CPU, whether threads split a reduction), so the order a row's terms are added in, and
    with it the row's bits, could change with the row count R. Halving by elementwise adds fixes the order."""
    while values.shape[0] > 1:
        if values.shape[0] % 2:
            values = torch.cat([values, torch.zeros_like(values[:1])])  # + 0.0 is exact
        values = values[0::2] + values[1::2]
    return values[0]


def merge_partials(parts: Partials) -> Partials:
    """One partial per row from [S, R] partials over disjoint column subsets (TP ranks' shards; the Triton forward's
    column tiles go through its `merge_tiles_kernel`, the same formulas), each row's terms added in an order fixed
    by S (`ordered_sum`): a row's result never depends on the other rows."""
    row_max = parts.row_max.amax(dim=0)  # exact in any order
    total, dot = rescale_partials(row_max, parts.row_max, parts.sum_exp, parts.shifted_dot)
    return Partials(row_max, ordered_sum(total), ordered_sum(dot), ordered_sum(parts.label_logit))


def combine_row_statistics(p: LogProbProblem, partials: Partials) -> RowStatistics:
    """Merge this rank's partials with the other ranks' over the same rows: every rank gathers all ranks' partials
    and merges them in rank order (`merge_partials`), so the result is the same on every rank and, at a fixed TP
    size, for a row whatever rows it is computed with (an all-reduce's summation order follows the message size).
    The gather is a SUM all-reduce of each rank's partials in its own slot and zeros elsewhere: exact (x + 0 is x),
    and it runs wherever all-reduce runs (gloo's CUDA tensors have no all-gather).

    When `p.label_is_max` is a buffer (the rows are then all of p.active_rows), also record whether
    each row's label logit equals the row max: the label logit is one rank's value plus exact zeros
    and the max is exact, so the comparison is exact (a tie counts as True)."""
    if p.tp_world_size > 1:
        mine = torch.stack(partials)
        slots = mine.new_zeros((p.tp_world_size, *mine.shape))
        slots[dist.get_rank(p.tp_group)] = mine
        dist.all_reduce(slots, op=dist.ReduceOp.SUM, group=p.tp_group)
        partials = merge_partials(Partials(*slots.unbind(1)))
    global_max, total, total_dot, label = partials
    if p.label_is_max is not None:
        p.label_is_max.index_copy_(0, p.active_rows, label >= global_max)
    log_sum = total.log()
    shifted_mean = total_dot / total
    log_probs = label - global_max - log_sum
    entropy = log_sum - shifted_mean if p.calculate_entropy else None
    return RowStatistics(log_probs, entropy, global_max, log_sum, shifted_mean)


def scatter_rows(p: LogProbProblem, values: Tensor | None) -> Tensor | None:
    """Full-length fp32 [N] tensor holding `values` at the scored rows and 0 elsewhere: `values` itself when every
    row is scored (active_rows is then 0..N-1 in order; two launches fewer after the kernel)."""
    if values is None:
        return None
    if values.numel() == p.num_rows:
        return values
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
