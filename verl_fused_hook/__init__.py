"""verl-fused-hook: fused log-probs and entropy for verl's Megatron engine via megatron-core's output_processor hook."""

from .ops import BACKEND_CHOICES, log_probs_and_entropy

__all__ = ["BACKEND_CHOICES", "log_probs_and_entropy"]
