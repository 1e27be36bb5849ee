"""The op: per-token log-probs and entropy from hidden states and a vocab-parallel output weight."""

from .backends import BACKEND_CHOICES
from .interface import log_probs_and_entropy

__all__ = ["BACKEND_CHOICES", "log_probs_and_entropy"]
