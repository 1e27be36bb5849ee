"""A core attention for megatron-core's local layer spec that accepts THD-packed batches.

The local spec's DotProductAttention refuses `packed_seq_params`; verl's engine
packs sequences (THD, `cu_seqlens`), which otherwise needs Transformer Engine.
Packed inputs here get block-diagonal causal attention: each sequence attends
only to its own earlier tokens. Unpacked inputs go to the parent, with the default causal mask built on the
inputs' device (megatron builds it on "cuda" when no mask is given).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            if attention_mask is None:
                size = (query.shape[0], key.shape[0])
                attention_mask = torch.ones(size, dtype=torch.bool, device=query.device).triu(1)[None, None]
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, None)
        if attention_bias is not None:
            raise ValueError("attention_bias: not supported with packed sequences by PackedDotProductAttention")
        cu_q = packed_seq_params.cu_seqlens_q_padded
        if cu_q is None:
            cu_q = packed_seq_params.cu_seqlens_q
        cu_kv = packed_seq_params.cu_seqlens_kv_padded
        if cu_kv is None:
            cu_kv = packed_seq_params.cu_seqlens_kv
        if not torch.equal(cu_q, cu_kv):
            raise ValueError("packed_seq_params: cu_seqlens_q and cu_seqlens_kv must match for self-attention")
        # query [t, heads, d], key/value [t, groups, d]
        repeat = query.shape[1] // key.shape[1]
        if repeat > 1:
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        total = query.shape[0]
        segment = torch.zeros(total, dtype=torch.long, device=query.device)
        boundaries = cu_q[1:-1].to(query.device).long()
        segment[boundaries[boundaries < total]] = 1
        segment = segment.cumsum(0)
        position = torch.arange(total, device=query.device)
        allowed = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])
        scores = torch.einsum("qhd,khd->hqk", query.float(), key.float()) * self.softmax_scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = self.attention_dropout(torch.softmax(scores, dim=-1)).to(value.dtype)
        context = torch.einsum("hqk,khd->qhd", probs, value)
        return context.reshape(total, -1)
