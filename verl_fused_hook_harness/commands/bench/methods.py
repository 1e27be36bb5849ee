"""The methods the op benchmark times: this package's op (each backend), full logits, verl's kernel and the
peers users pick instead (Liger-Kernel, cut-cross-entropy), the policy-loss methods (policy_loss.py), distillation
(distill.py) and sampling replay (replay.py).

Each method: fn(hidden, weight, labels, temperature, score_mask) -> (log_probs, entropy or None), or a scalar
loss for the loss methods (marked `fn.returns_loss`). A peer that is not installed is skipped with a line.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from verl_fused_hook.ops import log_probs_and_entropy

from ...stand_ins.verl_kernel_files import load_verl_linear_cross_entropy
from . import distill, liger_hopper, policy_loss, replay

ALL_METHODS = (
    "floor", "triton", "triton_keep", "triton_main_grad", "torch", "naive", "verl", "liger", "liger_sm90",
    "liger_tp_native", "cce", "fused_loss", "verl_loss",
    "fused_loss_gspo", "verl_loss_gspo", "kl_topk", "verl_kl_topk", "verl_kl_topk_chunked", "sum_pi_squared",
    "replay_given_20", "replay_given_64", "replay_given_512", "replay_given_mix", "replay_trainer",
    "replay_masked_logits",
)  # fmt: skip


# triton_keep: the op keeping logits for its backward within the fused loss's default budget of stored logits.
KEEP_LOGITS_BYTES = 4 * 1024**3


def ours(backend: str, keep_logits_bytes: int = 0):
    def fn(h, w, labels, temperature, score_mask=None):
        return log_probs_and_entropy(
            h,
            w,
            labels,
            temperature=temperature,
            score_mask=score_mask,
            backend=backend,
            keep_logits_bytes=keep_logits_bytes,
        )

    return fn


def ours_into_main_grad():
    """The op under megatron's DDP with gradient_accumulation_fusion: d_weight added into the weight's fp32
    `main_grad`, one buffer per weight shape kept across calls (DDP's gradient buffer, not the op's memory; a
    caller that sets `main_grad` first, as the accuracy check does, gets its own used)."""
    buffers: dict[tuple, torch.Tensor] = {}

    def fn(h, w, labels, temperature, score_mask=None):
        if w.requires_grad and torch.is_grad_enabled() and not hasattr(w, "main_grad"):
            key = (tuple(w.shape), w.device)
            if key not in buffers:
                buffers.clear()
                buffers[key] = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            w.main_grad = buffers[key]
            w.grad_added_to_main_grad = False
        return log_probs_and_entropy(
            h,
            w,
            labels,
            temperature=temperature,
            score_mask=score_mask,
            backend="triton",
            gradient_accumulation_fusion=True,
        )

    fn.adds_to_main_grad = True
    return fn


def naive(h, w, labels, temperature, score_mask=None):
    logits = (h @ w.t()).float() / temperature
    log_softmax = torch.log_softmax(logits, dim=-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1), entropy


def verl_kernel(kernel_dir: str | None):
    """verl's linear_cross_entropy (from --verl-kernel-dir, else the installed verl's files); None without it."""
    lce = load_verl_linear_cross_entropy(kernel_dir)
    if lce is None:
        return None

    def fn(h, w, labels, temperature, score_mask=None):
        return lce(h, w, labels, float(temperature), "none", None)

    return fn


def liger():
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss  # optional peer

    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")

    def fn(h, w, labels, temperature, score_mask=None):
        return -loss(w, h / temperature, labels), None

    return fn


def cut_cross_entropy():
    if importlib.util.find_spec("cut_cross_entropy") is None:
        return None
    from cut_cross_entropy import linear_cross_entropy

    def fn(h, w, labels, temperature, score_mask=None):
        return -linear_cross_entropy(h / temperature, w, labels, reduction="none"), None

    return fn


def load_methods(
    names,
    verl_kernel_dir,
    skipped: dict[str, str] | None = None,
    shapes: list[tuple[int, int, int]] = (),
    topk: int = 128,
    top_k_chunk_bytes: int | None = None,
) -> dict[str, Callable]:
    """The named methods that can run here (the floor is measured apart); why each other one cannot goes into
    `skipped` and on a line. `shapes`: every (N, H, V) the run will time (Liger's native kernel reserves its
    workspace for the largest once); `topk`: the teacher's top-k of the distillation methods;
    `top_k_chunk_bytes`: kl_topk's chunk budget (None: the op's default)."""
    loaders = {
        "triton": lambda: ours("triton"),
        "triton_keep": lambda: ours("triton", KEEP_LOGITS_BYTES),
        "triton_main_grad": ours_into_main_grad,
        "torch": lambda: ours("torch"),
        "naive": lambda: naive,
        "verl": lambda: verl_kernel(verl_kernel_dir),
        "liger": liger,
        "liger_sm90": liger_hopper.liger_sm90,
        "liger_tp_native": lambda: liger_hopper.liger_tp_native(shapes),
        "cce": cut_cross_entropy,
        "fused_loss": policy_loss.fused_loss_method,
        "verl_loss": lambda: policy_loss.verl_loss_method(verl_kernel(verl_kernel_dir)),
        "fused_loss_gspo": lambda: policy_loss.fused_loss_method("gspo"),
        "verl_loss_gspo": lambda: policy_loss.verl_loss_method(verl_kernel(verl_kernel_dir), "gspo"),
        **distill.loaders(topk, top_k_chunk_bytes),
        **replay.loaders(),
    }
    methods = {}
    for name in names:
        if name == "floor":
            continue
        fn = loaders[name]()
        if fn is None or isinstance(fn, str):
            reason = fn or "not installed"
            print(f"# {name}: {reason}; skipped", flush=True)
            if skipped is not None:
                skipped[name] = reason
        else:
            methods[name] = fn
    return methods
