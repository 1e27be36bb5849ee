"""Where d_weight goes: one fp32 sum, rounded once, into the returned gradient or onto Megatron's `main_grad`.

Why one sum: d_weight is a sum over blocks of rows (d_logits^T @ hidden rows). Summing bf16 partial
products would round at every block; summing in fp32 and rounding once keeps the gradient's
error that of a single GEMM, at the cost of an fp32 buffer only when there is more than one block.
With `accumulate` the sum goes on top of what `target` holds (Megatron's fp32 `main_grad`): then an fp32
target is its own buffer, however many blocks there are.

Why `main_grad`: under Megatron's DistributedDataParallel every parameter has a `main_grad` (fp32 with verl's
default grad_reduce_in_fp32) that the weight gradient ends up in. Returning d_weight makes autograd hold a
[V_local, H] tensor in the weight's dtype (1.16 GiB at 151936 x 4096 in bf16) that DDP then adds, rounded to
bf16 first. Megatron's own linear layers, with `gradient_accumulation_fusion`, add their weight gradient
into `main_grad` in backward and return a placeholder; the op does the same for its output layer
(`check_main_grad`, `returned_weight_grad`). An fp32 `main_grad` is also the fp32 sum the backward's blocks add
into, so the Triton backward can walk small groups of rows (triton_backend.row_groups) and keep its working
memory flat in the token count.
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


class InputGradients:
    """What a two-pass backward (two_pass.py, selected_tokens.py) returns for hidden and weight, built block by block.

    d_hidden starts as zeros (rows nobody scores keep them). d_weight starts empty with only its padding columns
    zeroed: the sum writes every valid one. With `owner` (a weight whose gradient goes into its `main_grad`) the
    sum adds there and the weight's returned gradient is Megatron's placeholder. A block's d_hidden is copied into
    its row span when every row is scored (one rounding copy), else index-copied to its rows.
    """

    def __init__(self, wants: tuple[bool, bool], hidden: tuple, weight: tuple, valid_columns: int, scored_rows: int,
                 owner: Tensor | None, device: torch.device):  # fmt: skip
        """`wants`: ctx.needs_input_grad of (hidden, weight); `hidden`, `weight`: their (shape, dtype)."""
        (hidden_shape, hidden_dtype), (weight_shape, weight_dtype) = hidden, weight
        want_hidden, want_weight = wants[0], wants[1]
        self.owner, self.valid_columns = owner, valid_columns
        self.every_row_scored = scored_rows == hidden_shape[0]  # then a block's rows are its span
        self.hidden = torch.zeros(hidden_shape, dtype=hidden_dtype, device=device) if want_hidden else None
        self.weight = None
        if want_weight and owner is None:
            self.weight = torch.empty(weight_shape, dtype=weight_dtype, device=device)
            self.weight[valid_columns:].zero_()
        self.weight_sum: WeightGradientSum | None = None

    def start(self, products: int) -> None:
        """The d_weight sum over `products` blocks (main_grad read now, as Megatron's layers do)."""
        if self.owner is not None:
            self.weight_sum = WeightGradientSum(self.owner.main_grad[: self.valid_columns], products, accumulate=True)
        elif self.weight is not None:
            self.weight_sum = WeightGradientSum(self.weight[: self.valid_columns], products)

    def store_hidden(self, block, d_hidden: Tensor | None) -> None:
        if d_hidden is None:
            return
        if self.every_row_scored:
            self.hidden[block.span].copy_(d_hidden)
        else:
            self.hidden.index_copy_(0, block.rows, d_hidden.to(self.hidden.dtype))

    def finish(self) -> tuple[Tensor | None, Tensor | None]:
        """(d_hidden, d_weight); with no block added (nothing flowed back) d_weight is zeros, main_grad untouched."""
        if self.weight_sum is not None:
            self.weight_sum.finish()
            self.weight_sum = None  # its fp32 buffer (a 16-bit main_grad's) is free before the placeholder
        elif self.weight is not None:
            self.weight.zero_()
        return self.hidden, self.weight if self.owner is None else returned_weight_grad(self.owner)


MAIN_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_main_grad(weight: torch.Tensor) -> torch.dtype:
    """The dtype of `weight.main_grad`; ValueError naming the field unless it is a tensor shaped like the weight,
    on its device, in one of MAIN_GRAD_DTYPES (what Megatron's DDP gives every parameter it wraps), and the weight
    is not a Megatron-FSDP parameter."""
    main_grad = getattr(weight, "main_grad", None)
    where = "gradient_accumulation_fusion=True adds d_weight into weight.main_grad"
    if getattr(weight, "__fsdp_param__", False):
        raise ValueError(
            f"{where}, but the weight is a Megatron-FSDP parameter, whose main_grad its own gradient hook makes "
            "(and may overwrite); pass gradient_accumulation_fusion=False to get d_weight returned"
        )
    if not isinstance(main_grad, torch.Tensor):
        raise ValueError(
            f"{where}, but the weight has no main_grad tensor (got {type(main_grad).__name__}); Megatron's "
            "DistributedDataParallel sets it on the parameters it wraps. Pass gradient_accumulation_fusion=False "
            "to get d_weight returned instead"
        )
    if main_grad.shape != weight.shape or main_grad.device != weight.device or main_grad.dtype not in MAIN_GRAD_DTYPES:
        raise ValueError(
            f"{where}: it must be shaped like the weight {tuple(weight.shape)} on {weight.device} in one of "
            f"{[str(d) for d in MAIN_GRAD_DTYPES]}, got {tuple(main_grad.shape)} on {main_grad.device} in "
            f"{main_grad.dtype}"
        )
    return main_grad.dtype


def returned_weight_grad(weight: torch.Tensor) -> torch.Tensor | None:
    """What backward returns for a weight whose gradient went into main_grad, as Megatron's fused linear layers do:
    None, unless DDP tracks `grad_added_to_main_grad` (its hook must still run, so it gets a placeholder and the
    flag that says not to add it). The placeholder is zeros when `zero_out_wgrad` says another use of the weight
    (a tied embedding on the same stage) adds its own gradient to it, uninitialized otherwise."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    if getattr(weight, "zero_out_wgrad", False):
        return torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
