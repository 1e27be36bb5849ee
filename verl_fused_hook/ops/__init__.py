"""The op: per-token log-probs and entropy from hidden states and a vocab-parallel output weight.

Three drivers over one contract with the backends (backends/): `log_probs_and_entropy` (statistics in forward,
logits recomputed in backward), `log_probs_entropy_and_loss` (a token-separable loss inside,
each chunk's logits computed once) and `token_log_probs` (log-probs of given ids per row, the row's top-k and
sum pi^2, two passes). `replayed_log_probs` renormalizes over each row's kept set (sampling replay) and touches only
those columns (replay.py). See docs/op.md.
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
from .replay import ReplayedLogProbs, replayed_log_probs
from .selected_tokens import TokenLogProbs, token_log_probs
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
    "ReplayedLogProbs",
    "TP_HIDDEN_CHOICES",
    "TokenLogProbs",
    "backend_capabilities",
    "backend_unavailable_at_build",
    "describe_backends",
    "check_temperature_values",
    "log_probs_and_entropy",
    "log_probs_entropy_and_loss",
    "replayed_log_probs",
    "token_log_probs",
]
