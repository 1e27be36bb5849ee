"""`e2e-bench`'s modes on packed (THD) batches: one micro-batch through verl's engine forward in each mode, its
GRPO-style loss and backward, what a parity sample keeps of it, how two samples compare, and the table.

The step calls verl's fused engine forward as verl's `forward_step` looks it up (so the plugin's reroute
applies); the masked mode hands it the rows the loss reads as the step's `score_rows`. On the CPU verl's Triton kernel
cannot run: the legacy forward's kernel is the portable op (`stand_ins/legacy_kernel_swap.py`).
"""

from __future__ import annotations

import contextlib

from verl_fused_hook.verl_integration.forward_step import HookStep

from ...stand_ins.legacy_kernel_swap import portable_legacy_kernel_on_cpu
from ...support.compare import VALUES, differing_parameters, max_abs, worst_gradient
from ...support.micro_batches import TEMPERATURE, grpo_loss, response_rows, response_values
from ...support.modes import Mode
from ...support.reports import gib, ms
from ...support.verl_engine import build_step, fused_engine_forward
from .common import snapshot_gradients, spread

MODES = (
    Mode("legacy", hook=False, kernel="verl"),
    Mode("hook+verl", hook=True, kernel="verl"),
    Mode("hook+ours", hook=True, kernel="ours"),
    Mode("hook+ours+mask", hook=True, kernel="ours", score_mask=True),
)
REFERENCE = {"thd": "legacy", "bshd": "verl-unfused"}
PARITY_KEY = {"thd": "vs_legacy", "bshd": "vs_verl_unfused"}


def enable_mode(model, engine, mode: Mode) -> str:
    """verl's build step for `mode` on `model`, through the environment switch; returns the resolved mode."""
    resolved = build_step(model, engine, "1" if mode.hook else "0")
    expected = "hook" if mode.hook else "legacy"
    if resolved != expected:
        raise RuntimeError(f"mode {mode.name}: verl's build step resolved {resolved!r}, expected {expected!r}")
    return resolved


class Step:
    """Forward (+ loss and backward) of one micro-batch in one mode."""

    def __init__(self, model, engine, batch, mode: Mode, device: str, cpu_kernel: str):
        self.model, self.engine, self.mode, self.device = model, engine, mode, device
        self.input_ids, self.data, self.advantages, self.old_offset, _ = batch
        self.cpu_kernel = cpu_kernel
        self.score_rows = None
        if mode.score_mask:
            self.score_rows = response_rows(self.data)  # the rows ppo_loss / forward-only steps read
            if self.score_rows is None:
                raise RuntimeError("score mask: the batch's prompt/response lengths do not describe input_ids")

    def kernel_context(self):
        """The portable op as the legacy forward's kernel on the CPU (hook modes never call that kernel)."""
        return (
            contextlib.nullcontext() if self.mode.hook else portable_legacy_kernel_on_cpu(self.device, self.cpu_kernel)
        )

    def forward(self):
        kwargs = {} if self.score_rows is None else {"step": HookStep(score_rows=self.score_rows)}
        with self.kernel_context():
            return fused_engine_forward(self.engine, self.model, self.input_ids, TEMPERATURE, **kwargs)

    def train(self):
        """Forward, loss, backward; gradients are written into .grad (callers free them between steps)."""
        output = self.forward()
        loss = grpo_loss(output["log_probs"], output["entropy"], self.data, self.advantages, self.old_offset)
        with self.kernel_context():
            loss.backward()
        return output, loss


def parity_sample(step: Step, repeatable) -> dict:
    """One forward+backward inside `repeatable()` (deterministic on CUDA), as a snapshot."""
    with repeatable():
        output, loss = step.train()
    return snapshot(step, output, loss)


def snapshot(step: Step, output, loss) -> dict:
    return {
        "log_probs": response_values(output["log_probs"], step.data).detach().float(),
        "entropy": response_values(output["entropy"], step.data).detach().float(),
        "all_log_probs": output["log_probs"].values().detach().float(),
        "policy_loss": loss.detach().float().reshape(1),
        "grads": snapshot_gradients(step.model),
    }


def compare_samples(reference: dict, other: dict) -> dict:
    """max_abs of log-probs/entropy (rows the loss reads) and loss; worst gradient max_abs and relative error."""
    rows = {
        key: None if reference[key] is None else max_abs(reference[key], other[key]) for key in VALUES
    }  # no entropy: sft
    differ = differing_parameters(reference["grads"], other["grads"])
    if differ:
        raise RuntimeError(f"gradient sets differ: {differ}")
    grads_max_abs, _ = worst_gradient(reference["grads"], other["grads"])
    grads_rel, worst_param = worst_gradient(reference["grads"], other["grads"], relative=True)
    return rows | {"grads_max_abs": grads_max_abs, "grads_rel": grads_rel, "worst_param": worst_param}


def parity_note(reference_name: str, parity: dict | None) -> str:
    """What a mode's progress line says about its parity with the reference."""
    if parity is None:
        return ""
    return (
        f"; vs {reference_name}: log_probs {parity['log_probs']:.3g}, entropy {parity['entropy']:.3g}, loss "
        f"{parity['policy_loss']:.3g}, grads {parity['grads_max_abs']:.3g} (rel {parity['grads_rel']:.2g})"
    )


def markdown_table(report: dict) -> str:
    lines = [
        "| tokens (sequences) | mode | kernel | fwd+bwd time | fwd+bwd peak | no-grad fwd time | no-grad fwd peak |"
        " log-prob max_abs | entropy max_abs | loss max_abs | grad max_abs (rel) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    parity_key = PARITY_KEY[report.get("layout", "thd")]
    for size in report["sizes"]:
        label = f"{size['tokens']:,} ({len(size['sequence_lengths'])})"
        if "layer_spec" in size:  # a run comparing layer specs (layer_specs.py)
            label += f", {size['layer_spec']}"
        if "padded_tokens" in size:
            label += f", padded {size['padded_tokens']:,}"
        for row in size["modes"]:
            if row.get("oom"):
                lines.append(f"| {label} | {row['mode']} | {row['kernel']} | OOM | OOM | | | | | | |")
                continue
            parity = row.get(parity_key)
            if parity is None:
                cells = ["reference"] * 4
            else:
                cells = [
                    f"{parity['log_probs']:.3g}",
                    f"{parity['entropy']:.3g}",
                    f"{parity['policy_loss']:.3g}",
                    f"{parity['grads_max_abs']:.3g} ({parity['grads_rel']:.2g})",
                ]
            lines.append(
                f"| {label} | {row['mode']} | {row['kernel']} | {ms(row['train_s'])}{spread(row.get('train_times_s'))} "
                f"| {gib(row['train_peak_bytes'])} | {ms(row['forward_s'])}{spread(row.get('forward_times_s'))} "
                f"| {gib(row['forward_peak_bytes'])} | " + " | ".join(cells) + " |"
            )
        floor = size.get("legacy_rerun")
        if floor is not None:
            lines.append(
                f"| {label} | legacy rerun | (repeatability) | | | | | {floor['log_probs']:.3g} | "
                f"{floor['entropy']:.3g} "
                f"| {floor['policy_loss']:.3g} | {floor['grads_max_abs']:.3g} ({floor['grads_rel']:.2g}) |"
            )
    return "\n".join(lines)
