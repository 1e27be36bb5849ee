"""`e2e-bench --layout bshd`: verl as it ships against hook mode, on `use_remove_padding=False` engines.

verl turns fused kernels off for padded engines, so its mode is the unfused
BSHD forward over full logits; hook mode keeps them on (bshd_forward). Both run
through verl's build step and `MegatronEngineWithLMHead.forward_step`, as a PPO
step does (no loss function: the hook scores only the rows the loss reads,
unless its backend is verl's kernel, which scores every row, padding included).
"""

from __future__ import annotations

import contextlib

from ...support.micro_batches import TEMPERATURE, forward_step_batch
from ...support.modes import Mode
from ...support.verl_engine import UNFUSED, build_step, megatron_engine
from .thd import Step

BSHD_MODES = (
    Mode("verl-unfused", hook=False, kernel="unfused"),  # the switch unset: verl as it ships
    Mode("hook+verl", hook=True, kernel="verl"),  # every real row and padding row, verl's kernel
    Mode("hook+ours+mask", hook=True, kernel="ours", score_mask=True),  # the rows the loss reads, this package's kernel
)


def padded_tokens(lengths: list[int]) -> int:
    """Rows of the padded batch at TP=1 (verl's preprocess_bshd_engine: every sequence padded to the longest)."""
    return len(lengths) * max(lengths)


def bshd_engine(model, mode: Mode, backend: str | None, hf_path: str):
    options = {"output_processor_backend": backend} if mode.hook else {}
    return megatron_engine([model], fused_kernel_options=options, model_path=hf_path, use_remove_padding=False)


def enable_bshd_mode(model, engine, mode: Mode) -> str:
    """verl's build step for `mode` on a padded engine; returns "unfused" (verl turned fused off) or "hook"."""
    resolved = build_step(model, engine, "1" if mode.hook else None)
    expected = "hook" if mode.hook else UNFUSED
    if resolved != expected:
        raise RuntimeError(f"mode {mode.name}: verl's build step resolved {resolved!r}, expected {expected!r}")
    return resolved


class BshdStep(Step):
    """One micro-batch through verl's forward_step on a padded engine: forward_step decides the rows the hook
    scores, not the caller."""

    def __init__(self, model, engine, batch, mode: Mode, device: str, cpu_kernel: str):
        super().__init__(model, engine, batch, mode, device, cpu_kernel)
        self.score_rows = None
        self.step_data = forward_step_batch(self.input_ids, self.data["prompts"], self.data["responses"], TEMPERATURE)

    def kernel_context(self):
        return contextlib.nullcontext()  # verl's legacy fused forward does not run on padded engines

    def forward(self):
        output, _ = self.engine.forward_step(iter([self.step_data]), self.model, None, lambda out, **_: out)
        return output
