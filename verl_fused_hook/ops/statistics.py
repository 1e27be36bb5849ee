"""Per-row softmax statistics shared by every backend: merging partial (vocab-split or
tensor-parallel) statistics and scattering scored rows back to full length.

A partial holds, per row and over some subset of columns: the max m, the sum
s = sum_j e^(z_j - m), the shifted dot d = sum_j e^(z_j - m)(z_j - m) and the
label logit (0 where the label is not in the subset). Keeping everything shifted
by the max keeps entropy exact for logits of any magnitude.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .problem import LogProbProblem


def rescale_partials(global_max, local_max, local_sum, local_shifted_dot):
    """A partial's (sum, shifted dot) re-expressed relative to `global_max` (>= its own max); partials
    without mass (no columns) give 0. Summing the results over partials merges them exactly."""
    has_mass = local_sum > 0
    safe_local_max = torch.where(has_mass, local_max, global_max)
    rescale = torch.where(has_mass, torch.exp(safe_local_max - global_max), torch.zeros_like(local_sum))
    # sum_j e^(z_j - M) (z_j - M) = rescale * (sum_j e^(z_j - m) (z_j - m) + (m - M) * sum_j e^(z_j - m))
    return local_sum * rescale, rescale * (local_shifted_dot + (safe_local_max - global_max) * local_sum)


def combine_row_statistics(p: LogProbProblem, local_max, local_sum, local_shifted_dot, label_logit):
    """Merge this rank's partial statistics with the other ranks'; return
    (log_probs, entropy or None, max, log sum-exp, shifted mean), all over the scored rows.

    When `p.label_is_max` is a buffer, also record whether each row's label logit equals the
    row max: the label logit is one rank's value plus exact zeros and the max a MAX all-reduce
    of values rounded the same way, so the comparison is exact (a tie counts as True)."""
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
    return log_probs, entropy, global_max, log_sum, shifted_mean


def scatter_rows(p: LogProbProblem, values: torch.Tensor | None) -> torch.Tensor | None:
    """Full-length fp32 [N] tensor holding `values` at the scored rows and 0 elsewhere."""
    if values is None:
        return None
    out = torch.zeros(p.num_rows, dtype=torch.float32, device=p.hidden.device)
    return out.index_copy_(0, p.active_rows, values)
