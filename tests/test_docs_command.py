"""docs/usage.md's GRPO command passes verl's own config validation (no GPU needed for that part).

The command is read from the docs, composed with verl's Hydra config exactly
as `python -m verl.trainer.main_ppo` composes it, and handed to verl's
`validate_config` with the same arguments `main_ppo.main` uses.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest

from verl_fused_hook.switch import HOOK, resolve_plan

USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"
SECTION = "### Example: GRPO with the Megatron engine"


def docs_command() -> tuple[dict[str, str], list[str]]:
    """(environment prefix, arguments after `python3 -m verl.trainer.main_ppo`) of the docs' GRPO command."""
    text = USAGE.read_text()
    block = re.search(r"```bash\n(.*?)```", text[text.index(SECTION) :], re.S).group(1)
    words = shlex.split(block.replace("\\\n", " "))
    module = words.index("verl.trainer.main_ppo")
    assert words[module - 2 : module] == ["python3", "-m"], words[: module + 1]
    environment = dict(word.split("=", 1) for word in words[: module - 2])
    return environment, words[module + 1 :]


def test_docs_grpo_command_passes_verls_validate_config(monkeypatch):
    import verl.trainer.main_ppo as main_ppo
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    environment, arguments = docs_command()
    config_names = [a.split("=", 1)[1] for a in arguments if a.startswith("--config-name=")]
    overrides = [a for a in arguments if not a.startswith("--")]
    assert config_names == ["ppo_trainer"] and "model_engine=megatron" in overrides  # not the deprecated trainer
    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose(config_name=config_names[0], overrides=overrides)
    assert config.actor_rollout_ref.actor.strategy == "megatron"
    assert config.actor_rollout_ref.ref.strategy == "megatron"
    assert config.actor_rollout_ref.model.use_fused_kernels is True
    with pytest.warns(UserWarning, match="Disabled critic"):  # GRPO has no critic; verl says so
        use_critic = need_critic(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=use_critic)
    # both halves of the switch the command sets resolve to hook mode, each on its own
    options = config.actor_rollout_ref.model.fused_kernel_options
    assert resolve_plan(options, environ={}).mode == HOOK
    assert resolve_plan(None, environ=environment).mode == HOOK
    assert resolve_plan(options, environ=environment).backend == "auto"
