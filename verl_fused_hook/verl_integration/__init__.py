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

from ..log_once import log_once
from .lazy_import import when_imported
from .ray_env import LOG_LEVEL_ENV, install_ray_env_forwarding

logger = logging.getLogger(__name__)


def _on_engine_import(engine_module) -> None:
    from .call_sites import install_build_gate

    install_build_gate(engine_module)


def _on_workers_import(workers_module) -> None:
    from .sampling_replay import install_init_model_wrapper

    install_init_model_wrapper(workers_module)


def _on_trainer_import(trainer_module) -> None:
    from .replay_carry import install_trainer_wrappers

    install_trainer_wrappers(trainer_module)


def _on_mbridge_import(util_module) -> None:
    from .mbridge_compat import apply

    apply(util_module)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level_from_env(environ=None) -> tuple[str, str | None]:
    """The level `VERL_FUSED_HOOK_LOGGING_LEVEL` names (default INFO), and a warning when it names none.

    A bad level must never stop `install()`: verl's plugin loader hides plugin errors at
    debug level, so raising here would switch the whole plugin off without a word.
    """
    raw = (os.environ if environ is None else environ).get(LOG_LEVEL_ENV)
    if raw is None:
        return "INFO", None
    if raw.strip().upper() in LOG_LEVELS:
        return raw.strip().upper(), None
    return "INFO", f"{LOG_LEVEL_ENV}={raw!r} is not a level; use one of {', '.join(LOG_LEVELS)}; using INFO"


def install() -> None:
    """Hook into verl's Megatron engine (and fix mbridge on megatron-core >= 0.18) once they are imported."""
    from ..switch import parse_env

    level, level_warning = log_level_from_env()
    logging.getLogger("verl_fused_hook").setLevel(level)
    if level_warning is not None:  # once: `import verl` installs us twice (package import and entry point)
        log_once(logger, f"verl_fused_hook: {level_warning}", logging.WARNING)
    try:
        parse_env()
    except ValueError as error:
        # verl's plugin loader swallows exceptions, so say it now; the engine build raises it again.
        log_once(
            logger, f"verl_fused_hook: {error} (the Megatron engine build will stop with this error)", logging.ERROR
        )
    when_imported("verl.workers.engine.megatron.transformer_impl", _on_engine_import)
    when_imported("verl.workers.engine_workers", _on_workers_import)
    when_imported("verl.trainer.ppo.ray_trainer", _on_trainer_import)
    when_imported("mbridge.core.util", _on_mbridge_import)
    install_ray_env_forwarding()


__all__ = ["install"]
