"""The op: per-token log-probs and entropy from hidden states and a vocab-parallel output weight.

Two drivers over one contract with the backends (backends.py): `log_probs_and_entropy` (statistics in forward,
logits recomputed in backward) and `log_probs_entropy_and_loss` (a token-separable loss inside,
each chunk's logits computed once). See docs/op.md.
"""

from .arguments import check_temperature_values
from .backends import (
    BACKEND_CHOICES,
    BackendCapabilities,
    backend_capabilities,
    backend_unavailable_at_build,
    describe_backends,
)
from .loss_inside import FusedLossResult, log_probs_entropy_and_loss
from .separability import LossGradientError, NonFiniteLossGradientError, NonSeparableLossError
from .tensor_parallel import TP_HIDDEN_CHOICES
from .two_pass import log_probs_and_entropy

__all__ = [
    "BACKEND_CHOICES",
    "BackendCapabilities",
    "FusedLossResult",
    "LossGradientError",
    "NonFiniteLossGradientError",
    "NonSeparableLossError",
    "TP_HIDDEN_CHOICES",
    "backend_capabilities",
    "backend_unavailable_at_build",
    "describe_backends",
    "check_temperature_values",
    "log_probs_and_entropy",
    "log_probs_entropy_and_loss",
]
