"""Context parallelism for the CPU stand-in attentions on verl's padded (BSHD) and packed (THD) layouts (tests only).

Why: megatron-core's local DotProductAttention refuses context parallelism
(only Transformer Engine's attention takes it), so on the CPU a CP run of
verl's paths needs a core attention that sees the whole sequence. Each CP
rank holds two zigzag halves of every sample (BSHD, verl's
`preprocess_bshd_engine`) or of every packed sequence (THD,
`preprocess_thd_engine`: chunks r and 2*cp-1-r of 2*cp, at local offset
cu_seqlens_padded / cp). This gathers keys and values (and the BSHD padding
mask) from every CP rank (the gradient of the gathered keys/values is summed
back to their owners) and attends causally by global position, within a
sample or packed sequence.
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
    """query [s_local, b, heads, d], key/value [s_local, b, groups, d], real [b, s_local] bool -> [s_local, b,
    heads*d]."""
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


def packed_zigzag_layout(
    cu_seqlens_padded: list[int], cp_rank: int, cp_size: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, position in its sequence) of a CP rank's local THD rows."""
    sequence, position = [], []
    for index, (start, end) in enumerate(zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:])):
        half = (end - start) // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - cp_rank - 1):
            position.append(torch.arange(chunk * half, (chunk + 1) * half, device=device))
            sequence.append(torch.full((half,), index, device=device))
    return torch.cat(sequence), torch.cat(position)


def context_parallel_packed_attention(query, key, value, cu_seqlens_padded, group, softmax_scale, dropout: float):
    """query [t_local, heads, d], key/value [t_local, groups, d] (THD, zigzag over CP) -> [t_local, heads*d]."""
    cp_size, cp_rank = dist.get_world_size(group), dist.get_rank(group)
    bounds = [int(b) for b in cu_seqlens_padded.tolist()]
    if any((end - start) % (2 * cp_size) for start, end in zip(bounds[:-1], bounds[1:])):
        raise ValueError(
            f"cu_seqlens_q_padded: every length must be a multiple of 2 * cp ({2 * cp_size}), got {bounds}"
        )
    keys, values = _GatherSequence.apply(key, group), _GatherSequence.apply(value, group)
    layouts = [packed_zigzag_layout(bounds, r, cp_size, query.device) for r in range(cp_size)]
    key_sequence = torch.cat([sequence for sequence, _ in layouts])
    key_position = torch.cat([position for _, position in layouts])
    query_sequence, query_position = layouts[cp_rank]
    allowed = (key_sequence[None, :] == query_sequence[:, None]) & (key_position[None, :] <= query_position[:, None])
    repeat = query.shape[1] // key.shape[1]
    q, k, v = query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)  # [heads, t, d]
    if repeat > 1:
        k, v = k.repeat_interleave(repeat, dim=0), v.repeat_interleave(repeat, dim=0)
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=allowed, dropout_p=dropout, scale=softmax_scale
    )[0]
    return out.transpose(0, 1).reshape(query.shape[0], -1)
