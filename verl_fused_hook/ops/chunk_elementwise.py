"""Elementwise passes over one chunk of fp32 logits, for the fused policy loss (portable version).

The fused loss computes a chunk's raw logits `raw = h @ W_local[:valid].T` once and
then needs two passes over them: the per-row softmax statistics (to form log-probs and
entropy) and, once the loss's per-row gradients are known, the gradient of the raw
logits. On CUDA with bf16 inputs the Triton path replaces both (the forward kernel keeps the
logits in fp16, ops/triton_chunk_kernels.py forms d_logits over them); these run everywhere else.
Conventions follow statistics.py: z = raw * inv_temp, everything shifted by the row max.
"""

from __future__ import annotations

import torch
from torch import Tensor


def chunk_statistics(raw: Tensor, label_col: Tensor, inv_temp: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row of `raw` (fp32 [R, C]): max_j z_j, sum_j e^(z_j - max), sum_j e^(z_j - max)(z_j - max),
    and z at `label_col` (int64 [R], -1 where the label is in another shard: 0 there); fp32 [R] each."""
    z = raw * inv_temp.unsqueeze(1)
    row_max = z.amax(dim=1)
    shifted = z.sub_(row_max.unsqueeze(1))
    exp_shifted = shifted.exp()
    sum_exp = exp_shifted.sum(dim=1)
    shifted_dot = exp_shifted.mul_(shifted).sum(dim=1)
    in_shard = label_col >= 0
    picked = raw.gather(1, label_col.clamp_min(0).unsqueeze(1)).squeeze(1) * inv_temp
    label_logit = torch.where(in_shard, picked, torch.zeros_like(picked))
    return row_max, sum_exp, shifted_dot, label_logit


def chunk_grad_logits(
    raw: Tensor,
    label_col: Tensor,
    inv_temp: Tensor,
    row_max: Tensor,
    log_sum: Tensor,
    shifted_mean: Tensor,
    g_lp: Tensor,
    g_ent: Tensor,
    out_dtype: torch.dtype,
) -> Tensor:
    """Gradient of sum_i g_lp_i log p_i + g_ent_i H_i with respect to the raw logits, [R, C] in out_dtype.

    row_max, log_sum = log sum e^(z - max) and shifted_mean = E[z] - max are the TP-merged
    (whole-vocabulary) statistics: dz_j = inv_temp * (g_lp ([j == y] - p_j) + g_ent p_j (E[z] - z_j)).
    """
    shifted = (raw * inv_temp.unsqueeze(1)).sub_(row_max.unsqueeze(1))
    probs = (shifted - log_sum.unsqueeze(1)).exp_()
    # g_ent (E[z] - z_j) - g_lp, built in place in `shifted`, then times p_j
    grad = shifted.neg_().add_(shifted_mean.unsqueeze(1)).mul_(g_ent.unsqueeze(1)).sub_(g_lp.unsqueeze(1)).mul_(probs)
    del probs
    in_shard = label_col >= 0
    grad.scatter_add_(1, label_col.clamp_min(0).unsqueeze(1), (g_lp * in_shard).unsqueeze(1))
    return grad.mul_(inv_temp.unsqueeze(1)).to(out_dtype)
