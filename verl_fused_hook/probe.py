"""Build-time check that a model exposes megatron-core's output_processor hook.

Run once when the model is built, so a missing hook stops the job at start-up
with an actionable message rather than hours later (or, worse, silently
falling back to another code path). The check reads `forward`'s signature,
never version strings, so dev builds and backports behave correctly.
"""

from __future__ import annotations

import inspect

import torch

HOOK_PARAMETERS = ("output_processor", "output_processor_context")
MODELS_WITHOUT_HOOK = ("HybridModel", "MambaModel")
# The oldest megatron-core the plugin supports (pyproject.toml's bound): 0.18.x has the hook but not every name
# the plugin reads (mtp_loss.megatron_mtp_gaps).
SUPPORTED_MEGATRON = "0.19.0"
_WRAPPER_ATTRIBUTES = ("module", "language_model")


class OutputProcessorUnsupportedError(RuntimeError):
    """The model cannot run fused_output_processor."""


def installed_megatron_version() -> str:
    try:
        from megatron.core import __version__
    except ImportError:
        return "not installed"
    return __version__


def unwrap_to_gpt(model: torch.nn.Module) -> torch.nn.Module:
    """Peel Float16Module, DDP and other `.module` wrappers, and VLM `.language_model` holders."""
    from megatron.core.models.gpt import GPTModel

    seen = set()
    while not isinstance(model, GPTModel) and id(model) not in seen:
        seen.add(id(model))
        inner = next(
            (
                getattr(model, name)
                for name in _WRAPPER_ATTRIBUTES
                if isinstance(getattr(model, name, None), torch.nn.Module)
            ),
            None,
        )
        if inner is None:
            break
        model = inner
    return model


def require_output_processor_support(model: torch.nn.Module) -> torch.nn.Module:
    """Return the GPTModel inside `model`; raise OutputProcessorUnsupportedError if it has no hook."""
    from megatron.core.models.gpt import GPTModel

    inner = unwrap_to_gpt(model)
    if not isinstance(inner, GPTModel):
        names = {cls.__name__ for cls in type(inner).__mro__}
        if names & set(MODELS_WITHOUT_HOOK):
            raise OutputProcessorUnsupportedError(
                f"{type(inner).__name__} has no output_processor hook in megatron-core (only GPTModel has one), "
                "so fused log-probs cannot run on it; unset VERL_FUSED_USE_OP_HOOK (or set it to 0) for this model"
            )
        raise OutputProcessorUnsupportedError(
            f"{type(inner).__name__} (unwrapped from {type(model).__name__}) is not a megatron-core GPTModel; "
            "the fused output processor needs a GPTModel, reached through .module wrappers or .language_model"
        )
    parameters = inspect.signature(inner.forward).parameters
    missing = [name for name in HOOK_PARAMETERS if name not in parameters]
    if missing:
        raise OutputProcessorUnsupportedError(
            f"{type(inner).__name__}.forward has no {' / '.join(missing)} parameter: the output_processor hook needs "
            f"megatron-core>=0.18.0 (upstream PR 4686) and verl_fused_hook needs >={SUPPORTED_MEGATRON}; installed "
            f"megatron-core is {installed_megatron_version()}. Upgrade with `pip install 'megatron-core>="
            f"{SUPPORTED_MEGATRON}'`, or set VERL_FUSED_USE_OP_HOOK=0 to keep verl's legacy forward"
        )
    return inner
