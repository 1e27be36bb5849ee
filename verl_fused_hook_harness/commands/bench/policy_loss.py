"""The bench's policy-loss methods: the output layer plus verl's `ppo_loss`, forward and backward.

fused_loss: `log_probs_entropy_and_loss` with verl's ppo_loss inside the op (logits once, three GEMMs).
verl_loss: verl's Triton kernel for log-probs and entropy, then verl's ppo_loss on them (verl's path).
Both run the same loss on the same synthetic actor-update batch: sequences of SEQUENCE_TOKENS tokens
(one prompt token, the rest response), GRPO-like settings (vanilla clipped loss, token-mean over the
batch's tokens, entropy bonus, low-variance KL to reference log-probs). fused_loss_gspo and verl_loss_gspo
run GSPO instead (`policy_loss.loss_mode=gspo`, seq-mean-token-mean, the paper's clip range): a sequence-level
loss, fused in chunks of whole sequences (`row_groups`). Needs `import verl`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from verl_fused_hook.ops import log_probs_entropy_and_loss
from verl_fused_hook.verl_integration.loss_support import ppo_loss_name
from verl_fused_hook.verl_integration.ppo_loss import ppo_loss_of_rows, ppo_loss_on_host, ppo_row_gradients, row_groups

from ...support.compare import relative_scalar
from ...support.reference import loss_reference, relative_error

SEQUENCE_TOKENS = 2048


LOSS_MODES = {  # policy loss mode: ActorConfig fields
    "vanilla": dict(loss_agg_mode="token-mean"),
    "gspo": dict(loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4),
}


def _loss_config(mode: str):
    import dataclasses

    from verl.workers.config import ActorConfig  # verl loads only when a loss method runs (`import verl` starts ray)

    config = ActorConfig(
        strategy="megatron",
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        entropy_coeff=0.001,
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        kl_loss_coef=0.001,
        **LOSS_MODES[mode],
    )
    return dataclasses.replace(config, policy_loss=dataclasses.replace(config.policy_loss, loss_mode=mode))


@functools.cache
def row_loss(n: int, device: str, mode: str = "vanilla") -> tuple[Callable, Callable, Callable, str, torch.Tensor]:
    """(loss_fn over N rows -> (loss, metrics), its row_gradients, its host twin, its name, each row's sequence)
    for a synthetic batch of N tokens on `device` and policy loss `mode`, as hook mode builds them."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss

    length = SEQUENCE_TOKENS if n % SEQUENCE_TOKENS == 0 else n
    sequences = n // length
    g = torch.Generator(device=device).manual_seed(n)

    def jagged(width: int, make):  # built from a list, as verl's batches are
        return torch.nested.as_nested_tensor([make((width,)) for _ in range(sequences)], layout=torch.jagged)

    response = length - 1
    data = tu.get_tensordict(
        {
            "prompts": jagged(1, lambda s: torch.zeros(s, dtype=torch.long, device=device)),
            "responses": jagged(response, lambda s: torch.zeros(s, dtype=torch.long, device=device)),
            "response_mask": jagged(response, lambda s: torch.ones(s, dtype=torch.long, device=device)),
            "old_log_probs": jagged(response, lambda s: -torch.rand(s, generator=g, device=device) * 3),
            "ref_log_prob": jagged(response, lambda s: -torch.rand(s, generator=g, device=device) * 3),
            "advantages": jagged(response, lambda s: torch.randn(s, generator=g, device=device)),
        },
        non_tensor_dict={"dp_size": 1, "batch_num_tokens": sequences * response, "global_batch_size": sequences},
    )
    offsets = torch.arange(sequences + 1, device=device) * length
    config = _loss_config(mode)
    to_nested = functools.partial(torch.nested.nested_tensor_from_jagged, offsets=offsets)
    loss_function = functools.partial(ppo_loss, config=config)
    return (
        ppo_loss_of_rows(loss_function, data, to_nested),
        ppo_row_gradients(config, data, to_nested, torch.Size([n]), device),
        ppo_loss_on_host(loss_function, data.to("cpu"), to_nested, torch.Size([n]), device),
        ppo_loss_name(config),
        row_groups(to_nested, torch.Size([n]), device),
    )


def _as_loss_method(fn):
    fn.returns_loss = True  # bench: back-propagate the returned scalar instead of (log_probs, entropy)
    return fn


def fused_loss_method(mode: str = "vanilla"):
    def fn(h, w, labels, temperature, score_mask=None):
        loss_fn, row_gradients, host_loss_fn, name, groups = row_loss(h.shape[0], str(h.device), mode)
        result = log_probs_entropy_and_loss(
            h,
            w,
            labels,
            loss_fn=loss_fn,
            loss_name=name,
            temperature=temperature,
            score_mask=score_mask,
            row_gradients=row_gradients,
            host_loss_fn=host_loss_fn,  # chunk_rows: the op's default, as hook mode
            row_groups=groups if mode == "gspo" else None,
        )
        return result.loss

    fn.loss_mode = mode
    return _as_loss_method(fn)


def verl_loss_method(verl_kernel: Callable | None, mode: str = "vanilla"):
    """verl's kernel (bench's `verl` method: (log_probs, entropy)) followed by verl's ppo_loss; None without it."""
    if verl_kernel is None:
        return None

    def fn(h, w, labels, temperature, score_mask=None):
        loss_fn = row_loss(h.shape[0], str(h.device), mode)[0]
        log_probs, entropy = verl_kernel(h, w, labels, temperature, score_mask)
        return loss_fn(log_probs, entropy)[0]

    fn.loss_mode = mode
    return _as_loss_method(fn)


def loss_accuracy(fn, hidden, weight, labels, temperature) -> dict:
    """Relative error of a loss method's loss and both gradients against fp64 logits and the same loss."""
    loss_fn = row_loss(hidden.shape[0], str(hidden.device), fn.loss_mode)[0]
    want_loss, want_dh, want_dw = loss_reference(
        hidden, weight, labels, lambda lp, ent: loss_fn(lp, ent)[0], temperature=temperature
    )
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = fn(h, w, labels, temperature, None)
    dh, dw = torch.autograd.grad(loss, (h, w))
    return {
        "log_prob_max_err": None,
        "entropy_max_err": None,
        "loss_rel_err": relative_scalar(want_loss.item(), loss.item()),
        "d_hidden_rel_err": relative_error(dh, want_dh),
        "d_weight_rel_err": relative_error(dw, want_dw),
    }
