"""FusedOutputProcessorContext validation and the processor's own errors (no model needed)."""

import dataclasses

import pytest
import torch

from verl_fused_hook import FusedOutputProcessorContext, fused_output_processor
from verl_fused_hook.output_layer import logit_multiplier, resolve_output_weight


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": 0}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "0.7"}, "temperature"),
        ({"temperature": torch.tensor([0.5, -1.0])}, "temperature"),
        ({"temperature": torch.ones(2, 3, 4)}, "temperature"),
        ({"calculate_entropy": 1}, "calculate_entropy"),
        ({"score_mask": torch.ones(2, 3)}, "score_mask"),
        ({"score_mask": torch.ones(6, dtype=torch.bool)}, "score_mask"),
        ({"backend": "fast"}, "backend"),
        ({"tile_rows": 0}, "tile_rows"),
        ({"vocab_size": -5}, "vocab_size"),
        ({"as_tuple": "yes"}, "as_tuple"),
        ({"backend": "verl", "score_mask": torch.ones(1, 3, dtype=torch.bool)}, "score_mask"),
        ({"backend": "verl", "temperature": torch.ones(1, 3)}, "temperature"),
        ({"backend": "verl", "vocab_size": 10}, "vocab_size"),
        ({"keep_logits_bytes": -1}, "keep_logits_bytes"),
        ({"keep_logits_bytes": 1.5}, "keep_logits_bytes"),
        ({"keep_logits_bytes": True}, "keep_logits_bytes"),
        ({"keep_logits_bytes": 1, "loss_fn": lambda log_probs, entropy: (log_probs.sum(), {})}, "keep_logits_bytes"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"calculate_sum_pi_squared": 1}, "calculate_sum_pi_squared"),
        ({"calculate_log_probs": None}, "calculate_log_probs"),
        ({"token_ids": torch.zeros(1, 3, 2)}, "token_ids"),  # not integer
        ({"token_ids": torch.zeros(1, 3, dtype=torch.long)}, "token_ids"),  # not [b, s, k]
        ({"backend": "verl", "top_k": 4}, "top_k"),  # verl's kernel has no token_log_probs
        ({"backend": "verl", "calculate_sum_pi_squared": True}, "calculate_sum_pi_squared"),
        ({"token_ids": torch.zeros(1, 3, 2, dtype=torch.long), "keep_logits_bytes": 1}, "token_ids"),
        ({"top_k": 2, "as_tuple": True}, "top_k"),
        (
            {"calculate_log_probs": False, "loss_fn": lambda log_probs, entropy: (log_probs.sum(), {})},
            "calculate_log_probs",
        ),
    ],
)
def test_bad_context_fields_are_named(kwargs, field):
    with pytest.raises(ValueError, match=f"FusedOutputProcessorContext.{field}"):
        FusedOutputProcessorContext(**kwargs)


def test_context_is_frozen_and_accepts_per_token_temperature():
    context = FusedOutputProcessorContext(
        temperature=torch.full((2, 5), 0.7), score_mask=torch.ones(2, 5, dtype=torch.bool)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.temperature = 1.0


def test_labels_are_required():
    layer = torch.nn.Linear(4, 10, bias=False)
    with pytest.raises(ValueError, match="labels: fused_output_processor computes log-probs"):
        fused_output_processor(hidden_states=torch.randn(3, 1, 4), output_layer=layer, labels=None)


def test_context_type_is_checked():
    layer = torch.nn.Linear(4, 10, bias=False)
    with pytest.raises(ValueError, match="output_processor_context: expected a FusedOutputProcessorContext"):
        fused_output_processor(
            hidden_states=torch.randn(3, 1, 4),
            output_layer=layer,
            labels=torch.zeros(1, 3, dtype=torch.long),
            context={"temperature": 1.0},
        )


class LoraWrappedOutput(torch.nn.Module):
    """An adapter-wrapped output layer: the base weight is hidden behind the adapter."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(4, 10, bias=False)
        self.lora_a = torch.nn.Linear(4, 2, bias=False)


def test_output_weight_resolution():
    layer = torch.nn.Linear(4, 10, bias=False)
    shared = torch.nn.Parameter(torch.randn(10, 4))
    assert resolve_output_weight(layer, shared) is shared  # tied: the embedding weight wins
    assert resolve_output_weight(layer, None) is layer.weight  # untied
    with pytest.raises(ValueError, match=r"output_layer \(LoraWrappedOutput\): no plain \[V_local, H\] weight"):
        resolve_output_weight(LoraWrappedOutput(), None)


def test_mup_multiplier_must_be_a_positive_constant():
    class Config:
        use_mup = True

    assert logit_multiplier(lambda logits: logits * 0.25, Config) == 0.25
    assert logit_multiplier(lambda logits: logits * 0.25, object()) == 1.0  # MuP off: never called
    with pytest.raises(ValueError, match="scale_logits"):
        logit_multiplier(lambda logits: logits + 1.0, Config)


def test_processor_on_a_plain_layer_matches_reference():
    """Outside Megatron (no TP group): [s, b, h] in, [b, s] out, b > 1, per-sample temperatures."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(6, 3, 8)  # [s, b, h]
    labels = torch.randint(0, 50, (3, 6))  # [b, s]
    temperature = torch.tensor([0.5, 1.0, 2.0])  # per sample
    out = fused_output_processor(
        hidden_states=hidden,
        output_layer=layer,
        labels=labels,
        context=FusedOutputProcessorContext(temperature=temperature),
    )
    logits = torch.einsum("sbh,vh->bsv", hidden.double(), layer.weight.double()) / temperature.double()[:, None, None]
    log_softmax = logits.log_softmax(-1)
    assert (out.log_probs - log_softmax.gather(-1, labels[..., None])[..., 0]).abs().max() < 1e-5
    assert (out.entropy + (log_softmax.exp() * log_softmax).sum(-1)).abs().max() < 1e-5


def test_processor_token_outputs_match_reference():
    """token_ids, top_k and sum pi^2 through the processor ([s, b, h] in, [b, s, ...] out): the op token_log_probs
    on the plain layer, against fp64 full logits; the label's log-prob left out when not asked."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(6, 3, 8, requires_grad=True)
    labels = torch.randint(0, 50, (3, 6))
    token_ids = torch.randint(0, 50, (3, 6, 4), dtype=torch.int32)
    temperature = torch.tensor([0.5, 1.0, 2.0])
    context = FusedOutputProcessorContext(
        temperature=temperature, token_ids=token_ids, top_k=3, calculate_sum_pi_squared=True, calculate_log_probs=False
    )
    out = fused_output_processor(hidden_states=hidden, output_layer=layer, labels=labels, context=context)
    logits = torch.einsum("sbh,vh->bsv", hidden.double(), layer.weight.double()) / temperature.double()[:, None, None]
    log_softmax = logits.log_softmax(-1)
    assert out.log_probs is None and out.entropy.shape == (3, 6)
    assert (out.token_log_probs - log_softmax.gather(-1, token_ids.long())).abs().max() < 1e-5
    top = log_softmax.topk(3, dim=-1)
    assert torch.equal(out.top_ids, top.indices) and (out.top_log_probs - top.values).abs().max() < 1e-5
    assert (out.sum_pi_squared - log_softmax.exp().pow(2).sum(-1)).abs().max() < 1e-6
    out.token_log_probs.sum().backward()
    (want,) = torch.autograd.grad(log_softmax.gather(-1, token_ids.long()).sum(), hidden)
    assert (hidden.grad - want).abs().max() < 1e-5


def test_processor_refuses_token_ids_shaped_unlike_labels():
    layer = torch.nn.Linear(4, 10, bias=False)
    context = FusedOutputProcessorContext(token_ids=torch.zeros(1, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"FusedOutputProcessorContext.token_ids: must be shaped like labels"):
        fused_output_processor(
            hidden_states=torch.randn(3, 1, 4), output_layer=layer, labels=torch.zeros(1, 3, dtype=torch.long),
            context=context,
        )  # fmt: skip
