"""The fused loss under (static) context parallelism, for token-level losses: no collective per chunk.

Why: under CP each rank's op holds two zigzag halves of every sequence, and verl's
unpacking (`postprocess_thd_engine`) all-gathers the rows over the CP group, so a
loss evaluated through it is a collective. The op differentiates its loss chunk by
chunk, and ranks with different numbers of scored rows run different numbers of
chunks: through verl's unpacking they would not call the all-gather in step. A
token-level loss's gradient at a row depends on that row's values only, so:

- per chunk (`row_gradients`): the loss's gradients at this rank's rows, from
  this rank's values alone, placed where verl's layout puts them (the other ranks'
  positions hold 0, which such a gradient does not read): no collective;
- once per call (the op's final evaluation, which every path of the op makes
  exactly once, so one all-gather on every CP rank): verl's loss through verl's
  unpacking on all ranks' final values: the loss value and metrics verl logs, and
  the exact gradients the op checks those of the chunks against (a loss that is
  not token-separable raises NonSeparableLossError instead of training wrongly).

Where each op row lands in verl's layout is read once per micro-batch by
unpacking globally numbered rows (one more all-gather, on every rank).
Sequence-level losses (a sequence's rows span every CP rank) are not fused under
CP (loss_support.py); the final evaluation stays on the device (host_loss_fn is
for collective-free losses).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .ppo_loss import ppo_row_gradients


def local_unpacker(to_nested: Callable[[torch.Tensor], torch.Tensor], row_shape: torch.Size, device, cp_rank: int):
    """A collective-free `to_nested` for this CP rank's op rows: verl's jagged layout of every rank's tokens, this
    rank's values at their positions and 0 elsewhere (differentiable in the values). Costs one all-gather
    (through `to_nested`, verl's unpacking), on every CP rank alike."""
    rows = row_shape.numel()
    numbered = torch.arange(rows, dtype=torch.float64, device=device) + (cp_rank * rows + 1)
    layout = to_nested(numbered.view(row_shape))
    row_of_position = layout.values().round().long() - 1  # global row numbers: rank * rows + local row
    own = torch.div(row_of_position, rows, rounding_mode="floor") == cp_rank
    positions = own.nonzero().squeeze(1)
    local_rows = row_of_position[own] - cp_rank * rows
    offsets, total = layout.offsets(), row_of_position.numel()

    def to_nested_local(values: torch.Tensor) -> torch.Tensor:
        flat = values.reshape(-1)
        placed = flat.new_zeros(total).index_put((positions,), flat.index_select(0, local_rows))
        return torch.nested.nested_tensor_from_jagged(placed, offsets)

    return to_nested_local


def local_row_gradients(loss_function, data, to_nested_local, row_shape: torch.Size, device, dp_group=None):
    """The op's row_gradients for any token-level verl loss: autograd of `loss_function` on the chunk's rows
    (every other row 0), through the collective-free `to_nested_local`."""
    rows_total = row_shape.numel()

    def spread(rows, values):
        return torch.zeros(rows_total, dtype=values.dtype, device=device).index_put((rows,), values).view(row_shape)

    def row_gradients(rows, log_prob, entropy):
        with torch.enable_grad():
            lp = log_prob.detach().float().requires_grad_(True)
            ent = None if entropy is None else entropy.detach().float().requires_grad_(True)
            model_output = {"log_probs": to_nested_local(spread(rows, lp))}
            if ent is not None:
                model_output["entropy"] = to_nested_local(spread(rows, ent))
            loss, _ = loss_function(model_output=model_output, data=data, dp_group=dp_group)
            inputs = [lp] if ent is None else [lp, ent]
            grads = torch.autograd.grad(loss, inputs, allow_unused=True)
        g_lp = grads[0] if grads[0] is not None else torch.zeros_like(lp)
        g_ent = None if ent is None else (grads[1] if grads[1] is not None else torch.zeros_like(ent))
        return g_lp, g_ent

    return row_gradients


def context_parallel_options(request, to_nested, row_shape: torch.Size, device) -> dict:
    """The op's per-chunk gradients for a CP rank (`request.cp_rank`): verl's fast per-row form where the loss
    mode has one (ppo_loss.FAST_ROW_GRADIENT_MODES), else autograd of the loss on this rank's rows."""
    to_nested_local = local_unpacker(to_nested, row_shape, device, request.cp_rank)
    gradients = None
    if request.config is not None:
        gradients = ppo_row_gradients(request.config, request.data, to_nested_local, row_shape, device)
    if gradients is None:
        gradients = local_row_gradients(request.loss_function, request.data, to_nested_local, row_shape, device,
                                        request.dp_group)  # fmt: skip
    return {"row_gradients": gradients, "host_loss_fn": None}
