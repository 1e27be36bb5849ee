"""How `hidden` is laid out over the tensor-parallel ranks (`tp_hidden`), and the communication that follows.

Why: every rank's vocabulary shard contributes to d_hidden, so each rank's own d_hidden is only
its shard's part; the op completes it, as Megatron's output layer does. These are Megatron's
own mappings (megatron/core/tensor_parallel/mappings.py), with the same torch.distributed
calls, so results match its path bit for bit:

- "replicated": every rank holds the full hidden; backward all-reduces d_hidden
  (`copy_to_tensor_model_parallel_region`).
- "sequence_sharded": each rank holds its slice of hidden's dim 0 (sequence parallelism); forward
  all-gathers along dim 0, backward reduce-scatters d_hidden
  (`gather_from_sequence_parallel_region(..., tensor_parallel_output_grad=True)`).
- "partial": every rank holds the full hidden and gets back its shard's partial d_hidden; the
  caller reduces (verl's kernel's contract).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TP_HIDDEN_CHOICES: tuple[str, ...] = ("replicated", "sequence_sharded", "partial")


def check_tp_hidden(tp_hidden) -> None:
    if tp_hidden not in TP_HIDDEN_CHOICES:
        raise ValueError(f"tp_hidden: unknown {tp_hidden!r}; allowed: {', '.join(TP_HIDDEN_CHOICES)}")


class _AllReduceGradient(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group."""

    @staticmethod
    def forward(ctx, hidden, group):
        ctx.group = group
        return hidden

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherRows(torch.autograd.Function):
    """Forward concatenates every rank's slice along dim 0; backward reduce-scatters the gradient back."""

    @staticmethod
    def forward(ctx, hidden, group, world_size):
        ctx.group, ctx.world_size = group, world_size
        gathered = torch.empty(
            (hidden.shape[0] * world_size, *hidden.shape[1:]), dtype=hidden.dtype, device=hidden.device
        )
        dist.all_gather_into_tensor(gathered, hidden.contiguous(), group=group)
        return gathered

    @staticmethod
    def backward(ctx, grad):
        mine = torch.empty((grad.shape[0] // ctx.world_size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(mine, grad.contiguous(), group=ctx.group)
        return mine, None, None


def full_hidden(hidden: torch.Tensor, tp_hidden: str, tp_group, tp_world_size: int) -> torch.Tensor:
    """Every row of `hidden` on this rank, wired so that backward returns this rank's complete
    d_hidden (or its partial one, for "partial"). One rank: `hidden` itself."""
    if tp_world_size == 1 or tp_hidden == "partial":
        return hidden
    if tp_hidden == "sequence_sharded":
        return _GatherRows.apply(hidden, tp_group, tp_world_size)
    return _AllReduceGradient.apply(hidden, tp_group)
