"""Hook mode's engine forward applies verl's temperature rule to real samples, however it is called.

verl's rule (its unfused path): values <= 0 are floored to 1e-8, and a value
that is not finite is an error (verl's fused path raises ValueError). The
engine forward is called directly here, as a user or recipe may call the
function `get_mcore_forward_fused_model_engine_fn` returns, on a real tiny
GPTModel in hook mode.
"""

from __future__ import annotations

import math

import pytest
import torch

from verl_fused_hook.verl_integration import call_sites, install
from verl_fused_hook.verl_integration.forward_step import VERL_TEMPERATURE_FLOOR, sample_temperatures
from verl_fused_hook_harness.stand_ins.megatron_cpu import build_cpu_gpt, init_model_parallel, tiny_transformer_config
from verl_fused_hook_harness.support.verl_engine import fused_engine_forward, megatron_engine

install()
import verl.workers.engine.megatron.transformer_impl as transformer_impl  # noqa: E402  (fires install's gate)

VOCAB = 192
LENGTHS = (5, 8, 4)


@pytest.mark.parametrize("value, expected", [(0.0, 1e-8), (-3.0, 1e-8), (0.5, 0.5), (2, 2.0)])
def test_float_temperature_follows_verls_floor(value, expected):
    assert sample_temperatures(value, 3) == expected


def test_tensor_temperature_follows_verls_floor():
    got = sample_temperatures(torch.tensor([0.0, -1.0, 0.7], dtype=torch.float64), 3)
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx([1e-8, 1e-8, 0.7])


@pytest.mark.parametrize(
    "temperature, message",
    [
        (math.nan, "temperature: must be finite"),
        (math.inf, "temperature: must be finite"),
        (torch.tensor([0.7, math.nan, 1.0]), "temperature: every per-sample value must be finite"),
        (torch.tensor([0.7, 1.0]), r"temperature: a tensor must be floating point and \[batch\] = \[3\]"),
        (torch.tensor([1, 1, 1]), r"temperature: a tensor must be floating point"),
        (torch.ones(3, 1), r"temperature: a tensor must be floating point and \[batch\]"),
        (torch.ones(3, device="meta"), "temperature: a tensor on the meta device"),
        ("1.0", "temperature: expected a float or a tensor"),
        (True, "temperature: expected a float or a tensor"),
    ],
)
def test_bad_temperature_is_a_value_error(temperature, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        sample_temperatures(temperature, 3)


@pytest.fixture(scope="module")
def hook_engine():
    init_model_parallel(1)
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=VOCAB, seed=11)
    engine = megatron_engine([model], fused_kernel_options={"use_output_processor_hook": True})
    engine._maybe_enable_fused_kernels()
    yield engine, model
    call_sites.restore()
    call_sites.install_build_gate(transformer_impl)


def _input_ids():
    generator = torch.Generator().manual_seed(5)
    parts = [torch.randint(1, VOCAB, (n,), generator=generator) for n in LENGTHS]
    return torch.nested.as_nested_tensor(parts, layout=torch.jagged)


def test_engine_forward_floors_non_positive_sample_temperatures(hook_engine):
    engine, model = hook_engine
    input_ids = _input_ids()
    with torch.no_grad():
        floored = fused_engine_forward(engine, model, input_ids, torch.tensor([0.0, -2.0, 0.7]))
        explicit = fused_engine_forward(
            engine, model, input_ids, torch.tensor([VERL_TEMPERATURE_FLOOR, VERL_TEMPERATURE_FLOOR, 0.7])
        )
        at_one = fused_engine_forward(engine, model, input_ids, torch.tensor([1.0, 1.0, 0.7]))
    for key in ("log_probs", "entropy"):
        assert torch.equal(floored[key].values(), explicit[key].values()), key
    # the sample at 1e-8 is not the sample at 1.0 (what the forward used to substitute)
    assert not torch.allclose(floored["log_probs"][0], at_one["log_probs"][0])


@pytest.mark.parametrize(
    "temperature, message",
    [
        (torch.tensor([0.7, math.nan, 1.0]), "every per-sample value must be finite"),
        (torch.tensor([0.7, 1.0]), r"\[batch\] = \[3\]"),
    ],
)
def test_engine_forward_refuses_bad_per_sample_temperatures(hook_engine, temperature, message):
    engine, model = hook_engine
    with torch.no_grad(), pytest.raises(ValueError, match=f"^temperature: .*{message}"):
        fused_engine_forward(engine, model, _input_ids(), temperature)
