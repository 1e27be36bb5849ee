"""d_weight added straight into Megatron's `main_grad`: its gradient-accumulation-fusion protocol.

Why: under Megatron's DistributedDataParallel every parameter has a `main_grad` (fp32 with verl's default
grad_reduce_in_fp32) that the weight gradient ends up in. Returning d_weight makes autograd hold a
[V_local, H] tensor in the weight's dtype (1.16 GiB at 151936 x 4096 in bf16) that DDP then adds, rounded to
bf16 first. Megatron's own linear layers, with `gradient_accumulation_fusion`, add their weight gradient
into `main_grad` in backward and return a placeholder; the op does the same for its output layer. An fp32
`main_grad` is also the fp32 sum the backward's blocks add into, so the Triton backward can walk small groups
of rows (triton_recompute.row_groups) and keep its working memory flat in the token count.
"""

from __future__ import annotations

import torch

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
            f"{[str(d) for d in MAIN_GRAD_DTYPES]}, got {tuple(main_grad.shape)} on {main_grad.device} in {main_grad.dtype}"
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
