"""require_output_processor_support on real megatron-core models and wrappers."""

import dataclasses

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.hybrid.hybrid_model import HybridModel
from megatron.core.transformer.module import Float16Module

from verl_fused_hook import OutputProcessorUnsupportedError, require_output_processor_support
from verl_fused_hook_harness.stand_ins.megatron_cpu import build_cpu_gpt, init_model_parallel, tiny_transformer_config
from verl_fused_hook_harness.support.distributed import run_in_processes


class DataParallelLike(torch.nn.Module):
    """Stands in for DDP's `.module` wrapping (megatron's DDP allocates CUDA grad buffers)."""

    def __init__(self, module):
        super().__init__()
        self.module = module


class VisionLanguageLike(torch.nn.Module):
    """A VLM-style holder whose text model is `.language_model`."""

    def __init__(self, language_model):
        super().__init__()
        self.vision = torch.nn.Linear(4, 4)
        self.language_model = language_model


class PreHookGPTModel(GPTModel):
    """A GPTModel whose forward has the pre-0.18 signature (no output_processor parameters)."""

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None):
        return super().forward(input_ids, position_ids, attention_mask, decoder_input, labels)


def probe_worker(rank, world_size):
    init_model_parallel(1)
    config = tiny_transformer_config()
    model = build_cpu_gpt(config, vocab_size=64)
    bf16_config = dataclasses.replace(config, bf16=True, params_dtype=torch.bfloat16)
    wrapped = DataParallelLike(Float16Module(bf16_config, build_cpu_gpt(bf16_config, vocab_size=64)))
    outcomes = {
        "plain": require_output_processor_support(model) is model,
        "float16_ddp": isinstance(require_output_processor_support(wrapped), GPTModel),
        "vlm": require_output_processor_support(DataParallelLike(VisionLanguageLike(model))) is model,
    }
    old = model
    old.__class__ = PreHookGPTModel  # the real model, seen through an old-style forward signature
    for key, candidate in {
        "old_signature": DataParallelLike(old),
        "non_gpt": DataParallelLike(torch.nn.Linear(3, 3)),
        # The real HybridModel class, created without __init__: its Mamba layers need CUDA kernels.
        "hybrid": DataParallelLike(HybridModel.__new__(HybridModel)),
    }.items():
        try:
            require_output_processor_support(candidate)
            outcomes[key] = None
        except OutputProcessorUnsupportedError as error:
            outcomes[key] = str(error)
    return outcomes


@pytest.fixture(scope="module")
def outcomes():
    return run_in_processes(probe_worker, 1)[0]


def test_probe_passes_through_wrappers(outcomes):
    assert outcomes["plain"] and outcomes["float16_ddp"] and outcomes["vlm"]


def test_probe_names_the_version_when_hook_parameters_are_missing(outcomes):
    from megatron.core import __version__

    message = outcomes["old_signature"]
    assert message is not None
    assert "output_processor / output_processor_context" in message
    assert "megatron-core>=0.18.0 (upstream PR 4686) and verl_fused_hook needs >=0.19.0" in message
    assert "pip install 'megatron-core>=0.19.0'" in message
    # megatron-core appends `git rev-parse --short HEAD` of the current directory to its version at import
    # time, so a commit between two imports changes the suffix: compare the release part
    assert f"installed megatron-core is {__version__.split('+')[0]}" in message
    assert "VERL_FUSED_USE_OP_HOOK=0" in message


def test_probe_rejects_models_without_a_hook(outcomes):
    assert "HybridModel has no output_processor hook" in outcomes["hybrid"]
    assert "Linear (unwrapped from DataParallelLike) is not a megatron-core GPTModel" in outcomes["non_gpt"]


def test_error_is_a_runtime_error():
    assert issubclass(OutputProcessorUnsupportedError, RuntimeError)
