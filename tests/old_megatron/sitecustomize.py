"""Test-only fake of a megatron-core older than 0.18: `GPTModel.forward` without the output_processor hook.

On PYTHONPATH, Python imports this at start-up in every process (spawned workers too), so a command run
in a subprocess sees a GPTModel whose forward lacks `output_processor` / `output_processor_context`."""

from megatron.core.models.gpt import gpt_model

_forward_with_hook = gpt_model.GPTModel.forward


def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None, **kwargs):
    return _forward_with_hook(self, input_ids, position_ids, attention_mask, decoder_input, labels, **kwargs)


gpt_model.GPTModel.forward = forward
