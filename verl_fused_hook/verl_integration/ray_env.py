"""The plugin's environment variables reach every Ray worker verl starts, on any cluster.

Why: on a cluster started with `ray start` (every multi-node job) workers are
children of the raylet, not of the driver, so a variable set in the driver's
shell never reaches them, and verl's `get_ppo_ray_runtime_env` forwards only a
fixed list. `main_ppo` builds its `ray.init` runtime env from that function (and
merges `ray_kwargs.ray_init.runtime_env` on top), so adding our variables to
what it returns puts them into every worker's environment. The wrapper is
installed only in a process where one of them is set, so without them verl's
function stays verl's own object.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

from ..switch import ENV_VAR
from .lazy_import import when_imported
from .replacements import replace

LOG_LEVEL_ENV = "VERL_FUSED_HOOK_LOGGING_LEVEL"
FORWARDED_ENV: tuple[str, ...] = (ENV_VAR, LOG_LEVEL_ENV)
RUNTIME_ENV_MODULE = "verl.trainer.constants_ppo"
RUNTIME_ENV_FUNCTION = "get_ppo_ray_runtime_env"


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The plugin's variables set in `environ` (default: this process), as Ray's env_vars want them (str)."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in FORWARDED_ENV if name in environ}


def _make_runtime_env_getter(verl_getter):
    @functools.wraps(verl_getter)
    def get_ppo_ray_runtime_env(*args, **kwargs):
        runtime_env = verl_getter(*args, **kwargs)
        runtime_env.setdefault("env_vars", {}).update(forwarded_env())  # read at call time, like verl's own
        return runtime_env

    return get_ppo_ray_runtime_env


def _on_runtime_env_import(module) -> None:
    # Runs right after the module executes, before `main_ppo`'s `from ... import` binds the name.
    replace(module, RUNTIME_ENV_FUNCTION, _make_runtime_env_getter)


def install_ray_env_forwarding() -> None:
    """Wrap verl's runtime-env builder when (and only when) this process sets one of FORWARDED_ENV."""
    if forwarded_env():
        when_imported(RUNTIME_ENV_MODULE, _on_runtime_env_import)
