"""A core attention for megatron-core's local layer spec that accepts THD-packed batches.

The local spec's DotProductAttention refuses `packed_seq_params`; verl's engine
packs sequences (THD, `cu_seqlens`), which otherwise needs Transformer Engine.
Packed inputs here get causal attention within each sequence, one
`scaled_dot_product_attention` call per sequence (flash/memory-efficient kernels
on CUDA), so nothing of size [tokens, tokens] is built. Unpacked inputs go to the
parent, with the default causal mask built on the inputs' device (megatron
builds it on "cuda" when no mask is given).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention


class PackedDotProductAttention(DotProductAttention):
    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
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
        # query [t, heads, d], key/value [t, groups, d] -> per sequence [heads, len, d]
        repeat = query.shape[1] // key.shape[1]
        dropout = self.attention_dropout.p if self.training else 0.0
        total = query.shape[0]
        bounds = [min(int(b), total) for b in cu_q.tolist()]
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            if end <= start:
                continue
            # [1, heads, len, d]: the fused (flash / memory-efficient) kernels take 4-D inputs only; 3-D ones
            # silently fall back to the math kernel, which builds the [heads, len, len] scores.
            q, k, v = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            if repeat > 1:
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=self.softmax_scale)
            pieces.append(out.squeeze(0).transpose(0, 1))
        if bounds[-1] < total:  # tokens past the last boundary (padding) attend to nothing: zeros
            pieces.append(query.new_zeros(total - bounds[-1], query.shape[1], value.shape[2]))
        return torch.cat(pieces).reshape(total, -1)
