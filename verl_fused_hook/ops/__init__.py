"""The op: per-token log-probs and entropy from hidden states and a vocab-parallel output weight."""

from .backends import BACKEND_CHOICES
from .loss_inside import FusedLossResult, LossGradientError, NonSeparableLossError, log_probs_entropy_and_loss
from .interface import log_probs_and_entropy

__all__ = [
    "BACKEND_CHOICES",
    "FusedLossResult",
    "LossGradientError",
    "NonSeparableLossError",
    "log_probs_and_entropy",
    "log_probs_entropy_and_loss",
]
