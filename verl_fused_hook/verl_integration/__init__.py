"""verl integration: the plugin that wires `fused_output_processor` into verl's Megatron engine.

`install()` is what verl's plugin loader (entry point group `verl.plugins`)
and `actor_rollout_ref.model.external_lib=verl_fused_hook` end up calling. It
only registers callbacks for when verl's Megatron engine and mbridge are
imported, so it is cheap, never imports megatron-heavy verl modules itself,
and is safe to call more than once.
"""

from __future__ import annotations

import logging
import os

from .lazy_import import when_imported

logger = logging.getLogger(__name__)

LOG_LEVEL_ENV = "VERL_FUSED_HOOK_LOGGING_LEVEL"


def _on_engine_import(engine_module) -> None:
    from .call_sites import install_build_gate

    install_build_gate(engine_module)


def _on_mbridge_import(util_module) -> None:
    from .mbridge_compat import apply

    apply(util_module)


def install() -> None:
    """Hook into verl's Megatron engine (and fix mbridge on megatron-core >= 0.18) once they are imported."""
    from ..switch import parse_env

    logging.getLogger("verl_fused_hook").setLevel(os.getenv(LOG_LEVEL_ENV, "INFO").upper())
    try:
        parse_env()
    except ValueError as error:
        # verl's plugin loader swallows exceptions, so say it now; the engine build raises it again.
        logger.error("verl_fused_hook: %s (the Megatron engine build will stop with this error)", error)
    when_imported("verl.workers.engine.megatron.transformer_impl", _on_engine_import)
    when_imported("mbridge.core.util", _on_mbridge_import)


__all__ = ["install"]
