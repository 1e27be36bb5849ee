"""A core attention for megatron-core's local layer spec that honours verl's padded (BSHD) attention mask.

verl's `preprocess_bshd_engine` hands the model a `[b, s]` bool mask, True on
real tokens; megatron-core's local DotProductAttention reads True as "masked"
and wants `[b, 1, sq, sk]`, so without Transformer Engine (every CPU) a padded
batch needs this stand-in. Each sample gets causal attention over its real
tokens only; padding query rows get zeros (nobody reads them). A sample whose
real tokens form one run (right or left padding) is sliced and run with
`is_causal`, so nothing of size [s, s] is built; any other mask shape (e.g.
context-parallel zigzag halves) gets an explicit per-sample mask. With context
parallelism the keys come from every CP rank (cp_attention.py), for padded and
packed (THD) batches alike. Other inputs (THD without CP, 4-D masks, no mask)
go to the THD-capable parent.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state

from .cp_attention import context_parallel_attention, context_parallel_packed_attention
from .thd_attention import PackedDotProductAttention


def is_padding_mask(attention_mask, query: torch.Tensor) -> bool:
    """True for verl's BSHD mask: bool [b, s] matching the query's [s, b, ...]."""
    return (
        isinstance(attention_mask, torch.Tensor)
        and attention_mask.dtype == torch.bool
        and attention_mask.dim() == 2
        and tuple(attention_mask.shape) == (query.shape[1], query.shape[0])
    )


def _single_run(real: torch.Tensor) -> tuple[int, int] | None:
    """(start, end) when the True entries of a 1-D bool tensor form one contiguous run, else None."""
    index = real.nonzero().flatten()
    if index.numel() == 0:
        return 0, 0
    start, end = int(index[0]), int(index[-1]) + 1
    return (start, end) if index.numel() == end - start else None


class PaddedDotProductAttention(PackedDotProductAttention):
    def __init__(self, config, *args, **kwargs):
        # megatron's local attention refuses context parallelism; this one takes it for padded batches
        # (cp_attention.py), so the parent is built from a CP=1 view of the config.
        super().__init__(
            dataclasses.replace(config, context_parallel_size=1) if config.context_parallel_size > 1 else config,
            *args,
            **kwargs,
        )
        self.config = config
        self.cp_group = parallel_state.get_context_parallel_group() if config.context_parallel_size > 1 else None

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if packed_seq_params is not None and self.cp_group is not None:
            if attention_bias is not None:
                raise ValueError("attention_bias: not supported with packed sequences by PaddedDotProductAttention")
            cu_seqlens = packed_seq_params.cu_seqlens_q_padded
            return context_parallel_packed_attention(
                query,
                key,
                value,
                cu_seqlens if cu_seqlens is not None else packed_seq_params.cu_seqlens_q,
                self.cp_group,
                self.softmax_scale,
                self.attention_dropout.p if self.training else 0.0,
            )
        if packed_seq_params is not None or not is_padding_mask(attention_mask, query):
            if self.cp_group is not None:
                raise ValueError(
                    "context parallelism: PaddedDotProductAttention takes it only with a [b, s] padding mask or THD"
                )
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if attention_bias is not None:
            raise ValueError("attention_bias: not supported with a padding mask by PaddedDotProductAttention")
        dropout = self.attention_dropout.p if self.training else 0.0
        if self.cp_group is not None:
            return context_parallel_attention(
                query, key, value, attention_mask.to(query.device), self.cp_group, self.softmax_scale, dropout
            )
        # query [s, b, heads, d], key/value [s, b, groups, d] -> per sample [1, heads, s, d]
        repeat = query.shape[2] // key.shape[2]
        seq, batch = query.shape[0], query.shape[1]
        real = attention_mask.to(query.device)
        causal = None
        outputs = []
        for i in range(batch):
            q, k, v = (x[:, i].transpose(0, 1).unsqueeze(0) for x in (query, key, value))
            if repeat > 1:
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
            out = q.new_zeros(1, q.shape[1], seq, v.shape[3])
            run = _single_run(real[i])
            if run is not None:
                start, end = run
                if end > start:
                    out[:, :, start:end] = F.scaled_dot_product_attention(
                        q[:, :, start:end],
                        k[:, :, start:end],
                        v[:, :, start:end],
                        dropout_p=dropout,
                        is_causal=True,
                        scale=self.softmax_scale,
                    )
            else:
                if causal is None:
                    causal = torch.ones(seq, seq, dtype=torch.bool, device=query.device).tril()
                allowed = causal & real[i][None, :]
                allowed |= ~allowed.any(dim=-1, keepdim=True)  # a row with no real key (padding): no NaN
                attended = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=allowed, dropout_p=dropout, scale=self.softmax_scale
                )
                out = attended * real[i][None, None, :, None]
            outputs.append(out.squeeze(0).permute(1, 0, 2))  # [s, heads, d]
        return torch.stack(outputs, dim=1).reshape(seq, batch, -1)
