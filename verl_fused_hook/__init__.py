"""verl-fused-hook: fused log-probs and entropy for verl's Megatron engine via megatron-core's output_processor hook."""

from .hook import FusedOutputProcessorContext, LogProbsOutput, fused_output_processor
from .ops import BACKEND_CHOICES, log_probs_and_entropy
from .probe import OutputProcessorUnsupportedError, require_output_processor_support

__all__ = [
    "BACKEND_CHOICES",
    "FusedOutputProcessorContext",
    "LogProbsOutput",
    "OutputProcessorUnsupportedError",
    "fused_output_processor",
    "log_probs_and_entropy",
    "require_output_processor_support",
]
