"""d_weight summed in fp32 and rounded once: the one accumulation every backend and driver adds into.

Why: d_weight is a sum over blocks of rows (d_logits^T @ hidden rows). Summing bf16 partial
products would round at every block; summing in fp32 and rounding once keeps the gradient's
error that of a single GEMM, at the cost of an fp32 buffer only when there is more than one block.
With `accumulate` the sum goes on top of what `target` holds (Megatron's fp32 `main_grad`, main_grad.py):
then an fp32 target is its own buffer, however many blocks there are.
"""

from __future__ import annotations

import torch
from torch import Tensor


class WeightGradientSum:
    """`target` (rows of d_weight, in the weight's dtype) as the sum of `products` products a_k.T @ b_k,
    a_k: d_logits [R, C], b_k: the block's hidden rows [R, H]; with `accumulate`, target plus that sum.

    One product: its GEMM writes `target` directly (no buffer). Several: they add into an fp32 total
    (`target` itself when fp32; else `buffer`, for a caller that reuses one, or a new one) that
    `finish()` rounds into `target` once. The first product overwrites (beta=0) unless it adds onto `target`
    itself under `accumulate`, so a reused buffer's old contents, NaN included, never count; a sum that got
    no product leaves zero (or, with `accumulate`, target as it was).
    """

    def __init__(self, target: Tensor, products: int, buffer: Tensor | None = None, accumulate: bool = False):
        self.target = target
        self.products = products
        self.accumulate = accumulate
        self.added = 0
        if products <= 1 or target.dtype == torch.float32:
            self.total = target
        elif buffer is not None:
            self.total = buffer
        else:
            self.total = torch.empty(target.shape, dtype=torch.float32, device=target.device)
        self._column_spans: set[tuple[int, int]] = set()  # columns() of a sum of several products

    @property
    def onto_target(self) -> bool:
        """Products add onto what `target` already holds (never overwrite it)."""
        return self.accumulate and self.total is self.target

    def add(self, a: Tensor, b: Tensor) -> None:
        beta = 1 if self.added or self.onto_target else 0
        self.added += 1
        if self.total.dtype != torch.float32:  # the one product, straight into a 16-bit target
            if a.dtype == self.target.dtype:
                torch.addmm(self.target, a.t(), b, beta=beta, out=self.target)
            elif beta:  # fp32 d_logits of a low-precision weight on the CPU: one rounding
                self.target.add_(a.t() @ b)
            else:
                self.target.copy_(a.t() @ b)
        elif a.dtype == torch.float32:
            self.total.addmm_(a.t(), b, beta=beta)
        else:  # bf16/fp16 operands on CUDA: cuBLAS accumulates and returns fp32
            torch.addmm(self.total, a.t(), b, beta=beta, out_dtype=torch.float32, out=self.total)

    def columns(self, start: int, stop: int, products: int, buffer: Tensor | None = None) -> WeightGradientSum:
        """The sum of columns [start, stop) (rows of d_weight) built from `products` products of its own, for a
        backend whose block walks the vocabulary in chunks. Of a sum of one product: those columns of `target`
        (`buffer`, if given, holds their fp32 sum). Of a sum of several (blocks of rows, each walking the
        vocabulary): this block's share, added into the fp32 total over what earlier blocks put in those columns
        (the first to ask for them overwrites, unless the total is an accumulating target)."""
        self.added = max(self.added, 1)
        if self.products == 1:
            return WeightGradientSum(self.target[start:stop], products, buffer, self.accumulate)
        share = WeightGradientSum(self.total[start:stop], products, accumulate=self.onto_target)
        share.added = int((start, stop) in self._column_spans)
        self._column_spans.add((start, stop))
        return share

    def finish(self) -> Tensor:
        if self.total is self.target:
            if self.added == 0 and not self.accumulate:
                self.target.zero_()
        elif self.added and self.accumulate:
            self.target.add_(self.total)
        elif self.added:
            self.target.copy_(self.total)
        elif not self.accumulate:
            self.target.zero_()
        return self.target
