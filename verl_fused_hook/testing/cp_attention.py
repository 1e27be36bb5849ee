"""Context parallelism for the CPU stand-in attention on verl's padded (BSHD) layout (tests only).

Why: megatron-core's local DotProductAttention refuses context parallelism
(only Transformer Engine's attention takes it), so on the CPU a CP run of
verl's BSHD path needs a core attention that sees the whole sequence. Each CP
rank holds two zigzag halves of every sample (verl's `preprocess_bshd_engine`:
chunks r and 2*cp-1-r of 2*cp). This gathers keys, values and the padding mask
from every CP rank (the gradient of the gathered keys/values is summed back
to their owners) and attends causally by global position over real keys.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _GatherSequence(torch.autograd.Function):
    """all_gather along dim 0 over `group`; backward: sum every rank's gradient, keep this rank's slice."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size = dist.get_world_size(ctx.group)
        return grad.chunk(size, dim=0)[dist.get_rank(ctx.group)], None


def zigzag_positions(local_len: int, cp_rank: int, cp_size: int, device) -> torch.Tensor:
    """Global positions of a CP rank's local rows (verl's and megatron's zigzag split)."""
    chunk = local_len // 2
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - cp_rank - 1) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def context_parallel_attention(query, key, value, real, group, softmax_scale, dropout: float) -> torch.Tensor:
    """query [s_local, b, heads, d], key/value [s_local, b, groups, d], real [b, s_local] bool -> [s_local, b, heads*d]."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    local_len, batch = query.shape[0], query.shape[1]
    keys, values = _GatherSequence.apply(key, group), _GatherSequence.apply(value, group)
    masks = [torch.empty_like(real) for _ in range(cp_size)]
    dist.all_gather(masks, real.contiguous(), group=group)
    key_real = torch.cat(masks, dim=1)  # [b, s_local * cp]
    key_pos = torch.cat([zigzag_positions(local_len, r, cp_size, query.device) for r in range(cp_size)])
    query_pos = zigzag_positions(local_len, cp_rank, cp_size, query.device)
    causal = key_pos[None, :] <= query_pos[:, None]  # [s_local, s_local * cp]
    repeat = query.shape[2] // key.shape[2]
    outputs = []
    for i in range(batch):
        q, k, v = query[:, i].transpose(0, 1), keys[:, i].transpose(0, 1), values[:, i].transpose(0, 1)
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=0), v.repeat_interleave(repeat, dim=0)
        allowed = causal & key_real[i][None, :]
        allowed = allowed | ~allowed.any(dim=-1, keepdim=True)  # a padding row with no real key: no NaN
        out = F.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=allowed, dropout_p=dropout, scale=softmax_scale
        )[0]
        outputs.append((out * real[i][None, :, None]).permute(1, 0, 2))  # [s_local, heads, d]; padding rows 0
    return torch.stack(outputs, dim=1).reshape(local_len, batch, -1)
