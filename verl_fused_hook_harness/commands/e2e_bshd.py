"""The end-to-end benchmark's padded (BSHD) layout: verl as it ships against hook mode, on `use_remove_padding=False`.

verl turns fused kernels off for padded engines, so its mode is the unfused
BSHD forward over full logits; hook mode keeps them on (bshd_forward). Both run
through verl's build step and `MegatronEngineWithLMHead.forward_step`, as a PPO
step does (no loss function: the hook scores only the rows the loss reads,
unless its backend is verl's kernel, which scores every row, padding included).
"""

from __future__ import annotations

import os

import torch

from verl_fused_hook.switch import ENV_VAR
from .ab_parity import TEMPERATURE
from .e2e_bench import Mode, Step, reset_fused_mode

BSHD_MODES = (
    Mode("verl-unfused", hook=False, kernel="unfused"),  # the switch unset: verl as it ships
    Mode("hook+verl", hook=True, kernel="verl"),  # every real row and padding row, verl's kernel
    Mode("hook+ours+mask", hook=True, kernel="ours", masked=True),  # the rows the loss reads, this package's kernel
)


def padded_tokens(lengths: list[int]) -> int:
    """Rows of the padded batch at TP=1 (verl's preprocess_bshd_engine: every sequence padded to the longest)."""
    return len(lengths) * max(lengths)


def bshd_engine(model, mode: Mode, backend: str | None, hf_path: str):
    from verl_fused_hook_harness.support.verl_engine import megatron_engine

    options = {"output_processor_backend": backend} if mode.hook else {}
    return megatron_engine([model], fused_kernel_options=options, model_path=hf_path, use_remove_padding=False)


def enable_bshd_mode(model, engine, mode: Mode) -> str:
    """verl's build step for `mode` on a padded engine; returns "unfused" (verl turned fused off) or "hook"."""
    from verl_fused_hook.verl_integration.model_plan import VERL_MODE_ATTRIBUTE

    reset_fused_mode(model)
    if mode.hook:
        os.environ[ENV_VAR] = "1"
    else:
        os.environ.pop(ENV_VAR, None)
    engine.engine_config.use_fused_kernels = True  # as configured; verl's build step decides
    engine._maybe_enable_fused_kernels()
    resolved = getattr(model, VERL_MODE_ATTRIBUTE, None) if engine.engine_config.use_fused_kernels else "unfused"
    expected = "hook" if mode.hook else "unfused"
    if resolved != expected:
        raise RuntimeError(f"mode {mode.name}: verl's build step resolved {resolved!r}, expected {expected!r}")
    return resolved


class BshdStep(Step):
    """One micro-batch through verl's forward_step on a padded engine."""

    def __init__(self, model, engine, batch, mode: Mode, device: str, cpu_kernel: str):
        super().__init__(model, engine, batch, mode, device, cpu_kernel)
        from verl.utils import tensordict_utils as tu

        self.score_rows = None  # forward_step decides (the rows ppo_loss reads), not the caller
        prompts, responses = self.data["prompts"], self.data["responses"]
        loss_mask = [torch.cat([torch.zeros_like(p), torch.ones_like(r)]) for p, r in zip(prompts.unbind(), responses.unbind())]
        self.step_data = tu.get_tensordict(
            {
                "input_ids": self.input_ids,
                "prompts": prompts,
                "responses": responses,
                "loss_mask": torch.nested.as_nested_tensor(loss_mask, layout=torch.jagged),
                "temperature": torch.full((len(loss_mask),), TEMPERATURE, device=self.input_ids.device),
            },
            non_tensor_dict={"calculate_entropy": True},
        )

    def _kernel_context(self):
        import contextlib

        return contextlib.nullcontext()

    def forward(self):
        output, _ = self.engine.forward_step(iter([self.step_data]), self.model, None, lambda out, **_: out)
        return output
