"""Portable backend: pure-PyTorch block passes (CPU and GPU), the math of softmax_math.py.

A block's fp32 logits live only while that block is processed. In the two-pass op the blocks
are tiles of `tile_rows` rows and the gradient pass recomputes each tile's logits; in the
loss-inside op a block is a chunk of fp32 logits near the chunk budget, kept from its
statistics to its gradients (4 bytes per logit, plus d_logits in place over them).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import Tensor

from ..arguments import LogProbProblem
from ..chunking import ChunkCost
from ..softmax_math import (
    LogitGradientInputs,
    Partials,
    grad_logits,
    inverse_temperature,
    label_columns,
    partial_statistics,
)
from ..token_math import (
    SparseLogitGradient,
    TokenPartials,
    TokenRequest,
    add_sparse_gradient,
    gather_token_logits,
    shard_top_candidates,
    square_sum,
)
from ..weight_gradient import WeightGradientSum
from . import RowBlock, SavedPasses

# The loss-inside op's chunk: 4 bytes of fp32 logits per logit plus the passes' temporaries, about three
# chunks at once; speed here is the GEMMs', so memory decides.
PORTABLE_CHUNK_BUDGET_BYTES = 2 * 1024**3
# Below this many rows per chunk (memory short on CUDA) the per-chunk costs (a whole-batch loss_fn call each,
# without row_gradients) outweigh the GEMM the chunk spares: the two-pass path runs instead.
PORTABLE_MIN_CHUNK_ROWS = 128
# Statistics run on blocks padded with zero rows to a multiple of this: on the CPU a product of a row count that is
# not a multiple of the BLAS kernel's row block (1, 2, 9 rows: matrix-vector or tail paths), and a reduction of a
# single row (threads split it), take other code paths, with other bits; in blocks of whole multiples, a row's logits
# and sums come out the same in any block (batch invariance; MKL on x86, measured in tests/test_batch_invariance.py).
STATISTICS_ROW_MULTIPLE = 8


def unavailable_reason(p: LogProbProblem) -> str | None:
    return None


def build_unavailable_reason(hidden_size: int, device_type: str) -> str | None:
    return None


def _tensor_cores(weight: Tensor) -> bool:
    return weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)


class _Gemms:
    """How a block's products run. bf16/fp16 on CUDA: tensor-core GEMMs that accumulate and
    return fp32 (`out_dtype`), with d_logits rounded to the input dtype for the two backward
    products, as the Triton backend and verl's kernel do. Everywhere else (CPU, fp32): fp32
    operands throughout (an fp32 copy of a low-precision weight shard), exact to fp32 rounding."""

    def __init__(self, weight: Tensor, valid_columns: int):
        self.mixed = _tensor_cores(weight)
        self.weight = weight[:valid_columns] if self.mixed else weight[:valid_columns].float()

    def rows(self, hidden: Tensor, rows: Tensor) -> Tensor:
        selected = hidden.index_select(0, rows)
        return selected if self.mixed else selected.float()

    def raw_logits(self, h: Tensor) -> Tensor:
        """fp32 h @ W.T, before any temperature."""
        if self.mixed:
            return torch.mm(h, self.weight.t(), out_dtype=torch.float32)
        return h @ self.weight.t()

    def grad_operand(self, grad_logits: Tensor) -> Tensor:
        return grad_logits.to(self.weight.dtype) if self.mixed else grad_logits

    def grad_hidden(self, grad_logits: Tensor) -> Tensor:
        if self.mixed:
            return torch.mm(grad_logits, self.weight, out_dtype=torch.float32)
        return grad_logits @ self.weight


class PortablePasses:
    """The portable passes of one call over `spans` of the scored rows (the loss-inside op's chunks), by
    default tiles of `p.tile_rows` (the two-pass op's); with `keep`, statistics keep the block's fp32 logits for
    the gradients of the same block."""

    overlap_final_evaluation = False  # the loss-inside op evaluates its loss in stream order after the GEMMs

    def __init__(self, p: LogProbProblem, keep: bool = False, spans: list[slice] | None = None):
        self.p, self.keep = p, keep
        self.gemms = _Gemms(p.weight, p.valid_columns)
        self.kept_logits = None
        active, tile = p.active_rows.numel(), p.tile_rows
        self.spans = spans if spans is not None else [slice(s, min(s + tile, active)) for s in range(0, active, tile)]
        self.block_count = len(self.spans)

    def blocks(self) -> Iterator[RowBlock]:
        active = self.p.active_rows
        for span in self.spans:
            rows = active[span]
            yield RowBlock(
                span,
                rows,
                self.gemms.rows(self.p.hidden, rows),
                label_columns(self.p, rows),
                inverse_temperature(self.p.temperature, rows),
            )

    def statistics(self, block: RowBlock) -> Partials:
        rows = block.hidden.shape[0]
        padding = -rows % STATISTICS_ROW_MULTIPLE
        hidden, label_col, inv_temp = block.hidden, block.label_col, block.inv_temp
        if padding:
            hidden = torch.cat([hidden, hidden.new_zeros(padding, hidden.shape[1])])
            label_col = torch.cat([label_col, label_col.new_full((padding,), -1)])
            inv_temp = torch.cat([inv_temp, inv_temp.new_ones(padding)])
        raw = self.gemms.raw_logits(hidden)
        if self.keep:
            self.kept_logits = raw[:rows]
        partials = partial_statistics(raw, label_col, inv_temp, entropy=self.p.calculate_entropy, keep_raw=self.keep)
        return Partials(*(t[:rows] for t in partials))

    def gradients(
        self, block: RowBlock, inputs: LogitGradientInputs, want_hidden: bool, weight_sum: WeightGradientSum | None
    ) -> Tensor | None:
        raw = self.kept_logits if self.keep else self.gemms.raw_logits(block.hidden)
        self.kept_logits = None
        grad = grad_logits(raw, block.label_col, block.inv_temp, inputs)
        grad = self.gemms.grad_operand(grad)
        if weight_sum is not None:
            weight_sum.add(grad, block.hidden)
        return self.gemms.grad_hidden(grad) if want_hidden else None

    def for_backward(self) -> SavedPasses:
        """The problem's tensors (the inputs, by reference: nothing per row beyond the driver's statistics),
        and how to rebuild these passes from them."""
        p = self.p
        temperature = p.temperature if isinstance(p.temperature, Tensor) else None
        stub = replace(
            p,
            hidden=None,
            weight=None,
            labels=None,
            active_rows=None,
            label_is_max=None,
            temperature=None if temperature is not None else p.temperature,
        )
        return SavedPasses(
            (p.hidden, p.weight, p.labels, p.active_rows, temperature), functools.partial(_rebuilt, stub, type(self))
        )


def _rebuilt(stub: LogProbProblem, passes_class, hidden, weight, labels, active_rows, temperature) -> PortablePasses:
    temperature = stub.temperature if temperature is None else temperature
    p = replace(stub, hidden=hidden, weight=weight, labels=labels, active_rows=active_rows, temperature=temperature)
    return passes_class(p)


class SelectedTokenPasses(PortablePasses):
    """`token_log_probs`' portable passes. The statistics' blocks are padded with zero rows to a multiple of
    STATISTICS_ROW_MULTIPLE, as the two-pass op's, so a row's outputs are bitwise the same alone or in any batch; the
    asked ids' logits, the square sum and the top candidates are read off the block's fp32 logits, the statistics'
    own values."""

    def __init__(self, p: LogProbProblem, request: TokenRequest | None = None):
        super().__init__(p)
        self.request = request

    def token_statistics(self, block: RowBlock) -> tuple[Partials, TokenPartials]:
        count, request = block.rows.numel(), self.request
        padding = -count % STATISTICS_ROW_MULTIPLE
        hidden, label_col, inv_temp = block.hidden, block.label_col, block.inv_temp
        if padding:
            hidden = torch.cat([hidden, hidden.new_zeros(padding, hidden.shape[1])])
            label_col = torch.cat([label_col, label_col.new_full((padding,), -1)])
            inv_temp = torch.cat([inv_temp, inv_temp.new_ones(padding)])
        z = self.gemms.raw_logits(hidden).mul_(inv_temp.unsqueeze(1))
        token_logits = squares = top_values = top_ids = None
        if request.token_columns is not None:
            token_logits = gather_token_logits(z[:count], request.token_columns[block.span])
        if request.sum_squares:
            squares = square_sum(z)[:count]
        if request.top_k:
            top_values, top_ids = shard_top_candidates(
                z[:count], request.top_k, self.p.vocab_start, self.p.batch_invariant
            )
        ones = torch.ones_like(inv_temp)  # z holds 1/T already
        partials = partial_statistics(z, label_col, ones, entropy=self.p.calculate_entropy, keep_raw=False)
        return Partials(*(part[:count] for part in partials)), TokenPartials(token_logits, squares, top_values, top_ids)

    def token_gradients(
        self,
        block: RowBlock,
        inputs: LogitGradientInputs,
        sparse: SparseLogitGradient,
        want_hidden: bool,
        weight_sum: WeightGradientSum | None,
    ) -> Tensor | None:
        """d_hidden of the block's rows (or None) and their share of d_weight: the dense part as the label gradient's
        (`inputs`, with the label itself among `sparse`), plus `sparse`."""
        raw = self.gemms.raw_logits(block.hidden)
        no_label = torch.full_like(block.label_col, -1)
        grad = add_sparse_gradient(grad_logits(raw, no_label, block.inv_temp, inputs), sparse, block.inv_temp)
        grad = self.gemms.grad_operand(grad)
        if weight_sum is not None:
            weight_sum.add(grad, block.hidden)
        return self.gemms.grad_hidden(grad) if want_hidden else None


def selected_token_passes(p: LogProbProblem, request: TokenRequest) -> SelectedTokenPasses:
    """`token_log_probs`'s passes: tiles of exactly p.tile_rows rows, logits recomputed in the gradients."""
    return SelectedTokenPasses(p, request)


def two_pass_passes(p: LogProbProblem, for_backward: bool = False) -> PortablePasses:
    """Tiles of p.tile_rows whose backward recomputes the logits, for_backward or not (no keep_logits here)."""
    return PortablePasses(p)


def loss_inside_cost(p: LogProbProblem, keep: bool) -> ChunkCost:
    """Per scored row: 4 bytes per logit kept (what the budget limits); beside them z and e^(z - m) in the
    statistics (8 per logit; 4 without keeping, in place), p_j in the gradients (4, and on CUDA the d_logits
    operand in the input dtype, 2: no more than the statistics'), the row's hidden copy and, with gradients,
    its fp32 d_hidden and that rounded. Fixed: the fp32 copy of a low-precision weight off the tensor cores."""
    columns, h = max(1, p.valid_columns), p.hidden.shape[1]
    mixed = _tensor_cores(p.weight)
    row_copy = p.hidden.element_size() if mixed else 4
    transient = (8 if keep else 4) * columns + h * (row_copy + (4 + p.hidden.element_size() if keep else 0)) + 64
    weight_copy = 0 if mixed or p.weight.dtype == torch.float32 else 4 * p.valid_columns * h
    return ChunkCost(4 * columns, transient, weight_copy, PORTABLE_MIN_CHUNK_ROWS, 1, PORTABLE_CHUNK_BUDGET_BYTES)


def loss_inside_passes(p: LogProbProblem, keep: bool, spans: list[slice]) -> PortablePasses:
    """The chunks `spans` (chunking.plan_chunks), each block's fp32 logits kept when `keep`."""
    return PortablePasses(p, keep, spans)
