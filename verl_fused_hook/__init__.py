"""verl-fused-hook: fused log-probs and entropy for verl's Megatron engine via megatron-core's output_processor hook.

The op imports only torch; the hook and the probe (which import megatron-core)
load on first use, so `from verl_fused_hook import log_probs_and_entropy` stays light.
"""

import importlib

from .ops import (
    BACKEND_CHOICES,
    ReplayedLogProbs,
    TokenLogProbs,
    log_probs_and_entropy,
    log_probs_entropy_and_loss,
    replayed_log_probs,
    token_log_probs,
)

_LAZY = {
    "FusedOutputProcessorContext": ".context",
    "SamplingReplay": ".context",
    "LogProbsOutput": ".hook",
    "fused_output_processor": ".hook",
    "OutputProcessorUnsupportedError": ".probe",
    "require_output_processor_support": ".probe",
}

__all__ = [
    "BACKEND_CHOICES",
    "ReplayedLogProbs",
    "TokenLogProbs",
    "log_probs_and_entropy",
    "log_probs_entropy_and_loss",
    "replayed_log_probs",
    "token_log_probs",
    *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _install_verl_integration_if_verl_is_loaded() -> None:
    """`external_lib=verl_fused_hook` (or importing us after verl) installs the integration;
    without verl this does nothing, so GPU boxes without verl/ray import us fine."""
    import sys

    if "verl" in sys.modules:
        from .verl_integration import install

        install()


_install_verl_integration_if_verl_is_loaded()
