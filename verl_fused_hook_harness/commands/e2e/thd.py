"""`e2e-bench`'s modes on packed (THD) batches: one micro-batch through verl's engine forward in each mode, its
GRPO-style loss and backward, what a parity sample keeps of it, how two samples compare, and the table.

The step calls verl's fused engine forward as verl's `forward_step` looks it up (so the plugin's reroute
applies); the masked mode hands it the rows the loss reads as the step's `score_rows`. On the CPU verl's Triton kernel
cannot run: the legacy forward's kernel is the portable op (`stand_ins/legacy_kernel_swap.py`).

The replay modes (`--replay TOP_K,TOP_P`) build their engine with `output_processor_sampling_replay=true` inside
`rollout_sampling(...)` and hand the step its `SamplingReplay` as verl's `forward_step` would (`replay_of_step`):
kept sets computed from top_k / top_p on the trainer's logits, or given in the batch as `rollout_kept_ids`
(synthetic: the e2e batch's tokens were not sampled from the model). Their log-probs are renormalized over each
token's kept set, so there is no parity with legacy to measure: their row records instead how the replayed
log-probs stand against legacy's full-vocabulary ones on the rows the loss reads (`replay_against_full`).
"""

from __future__ import annotations

import contextlib

import torch

from verl_fused_hook.probe import unwrap_to_gpt
from verl_fused_hook.verl_integration.forward_step import HookStep, replay_of_step
from verl_fused_hook.verl_integration.model_plan import plan_of
from verl_fused_hook.verl_integration.replay_carry import kept_ids_of_outputs
from verl_fused_hook.verl_integration.sampling_replay import KEPT_IDS_KEY

from ...stand_ins.legacy_kernel_swap import portable_legacy_kernel_on_cpu
from ...support.compare import VALUES, differing_parameters, max_abs, worst_gradient
from ...support.micro_batches import TEMPERATURE, grpo_loss, response_rows, response_values, synthetic_kept_sets
from ...support.modes import COMPUTED_SETS, GIVEN_SETS, Mode
from ...support.reports import gib, ms, on_device
from ...support.verl_engine import build_step, fused_engine_forward
from .common import snapshot_gradients, spread

MODES = (
    Mode("legacy", hook=False, kernel="verl"),
    Mode("hook+verl", hook=True, kernel="verl"),
    Mode("hook+ours", hook=True, kernel="ours"),
    Mode("hook+ours+mask", hook=True, kernel="ours", score_mask=True),
)
# With --replay TOP_K,TOP_P: hook+ours+mask with sampling replay, the kept sets computed in the trainer or given.
REPLAY_MODES = (
    Mode("hook+ours+mask+replay", hook=True, kernel="ours", score_mask=True, replay=COMPUTED_SETS),
    Mode("hook+ours+mask+replay-given", hook=True, kernel="ours", score_mask=True, replay=GIVEN_SETS),
)
REFERENCE = {"thd": "legacy", "bshd": "verl-unfused"}
PARITY_KEY = {"thd": "vs_legacy", "bshd": "vs_verl_unfused"}
REPLAY_KEY = "replay_vs_full"  # a replay mode's row: its log-probs against legacy's full-vocabulary ones
KEPT_SETS_SEED = 0  # the given-sets mode's synthetic sets (the batch's tokens come from --seed)

REPLAY_NOTE = (
    "Replay rows (rollout top_k={top_k}, top_p={top_p:g}): no parity with legacy, whose log-probs are over the whole "
    "vocabulary (replay renormalizes log-probs and entropy over each token's kept set, so loss and gradients differ "
    "by design). Their log-prob cell: the smallest log p_S - log p_legacy over the rows the loss reads (>= 0 up to "
    "the kernels' noise: a set holding the label cannot lower its probability) and the mean kept mass "
    "exp(log p_legacy - log p_S). Computed sets (+replay): the batch's tokens are random, not sampled, so most fall "
    "outside their top-k/top-p set and are added to it. Given sets (+replay-given): synthetic rollout_kept_ids, each "
    "token's set its label and 0 to top_k - 1 random other ids."
)


def fused_kernel_options(mode: Mode, kernels: dict[str, str]) -> dict:
    """The engine's `fused_kernel_options` for a hook `mode` (kernels: kernel name -> backend on this device)."""
    return {
        "output_processor_backend": kernels[mode.kernel],
        **({"output_processor_sampling_replay": True} if mode.replay else {}),
    }


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
        # replay: the no-grad forward is the old-log-prob pass (computed sets allowed there); a training step replays
        # given sets only: with computed sets, pi_old's from one no-grad forward, as the plugin's driver carries them
        self.replay = self.training_replay = None
        if mode.replay:
            self.replay = step_replay(model, self.data, mode.replay, forward_only=True)
            self.training_replay = (
                step_replay(model, self.data, mode.replay, forward_only=False)
                if mode.replay == GIVEN_SETS
                else self.pi_old_sets_replay()
            )

    def pi_old_sets_replay(self):
        """The training step's SamplingReplay over the sets a no-grad forward computed (pi_old's), carried into the
        batch as `rollout_kept_ids` the way the plugin's driver wrapper carries them."""
        with torch.no_grad():
            output = self.forward()
        data = self.data.copy()
        data[KEPT_IDS_KEY] = kept_ids_of_outputs(output, self.data)
        return replay_of_step(data, plan_of(self.model), {}, forward_only=False)

    def kernel_context(self):
        """The portable op as the legacy forward's kernel on the CPU (hook modes never call that kernel)."""
        return (
            contextlib.nullcontext() if self.mode.hook else portable_legacy_kernel_on_cpu(self.device, self.cpu_kernel)
        )

    def forward(self):
        replay = self.training_replay if torch.is_grad_enabled() else self.replay
        kwargs = {"step": HookStep(score_rows=self.score_rows, replay=replay)} if self.mode.hook else {}
        with self.kernel_context():
            return fused_engine_forward(self.engine, self.model, self.input_ids, TEMPERATURE, **kwargs)

    def train(self):
        """Forward, loss, backward; gradients are written into .grad (callers free them between steps)."""
        output = self.forward()
        loss = grpo_loss(output["log_probs"], output["entropy"], self.data, self.advantages, self.old_offset)
        with self.kernel_context():
            loss.backward()
        return output, loss


def step_replay(model, data, kept_sets: str, forward_only: bool):
    """The step's SamplingReplay as verl's forward_step makes it from `model`'s plan (built with replay on): the
    sets computed from the plan's top_k / top_p, or (GIVEN_SETS) `synthetic_kept_sets` of width top_k as the batch's
    `rollout_kept_ids`."""
    plan = plan_of(model)
    if kept_sets == GIVEN_SETS:
        responses = data["responses"]
        kept = synthetic_kept_sets(responses, plan.replay_top_k, unwrap_to_gpt(model).vocab_size, KEPT_SETS_SEED)
        data = data.copy()
        data[KEPT_IDS_KEY] = kept
    return replay_of_step(data, plan, {}, forward_only)


def parity_sample(step: Step, repeatable, *, gradients_to_cpu: bool = False) -> dict:
    """One forward+backward inside `repeatable()` (deterministic on CUDA), as a snapshot (its gradients on the CPU
    with `gradients_to_cpu`: a reference held while other modes run)."""
    with repeatable():
        output, loss = step.train()
    return snapshot(step, output, loss, gradients_to_cpu=gradients_to_cpu)


def snapshot(step: Step, output, loss, *, gradients_to_cpu: bool = False) -> dict:
    return {
        "log_probs": response_values(output["log_probs"], step.data).detach().float(),
        "entropy": response_values(output["entropy"], step.data).detach().float(),
        "all_log_probs": output["log_probs"].values().detach().float(),
        "policy_loss": loss.detach().float().reshape(1),
        "grads": snapshot_gradients(step.model, to_cpu=gradients_to_cpu),
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


def replay_against_full(reference: dict, replayed: dict) -> dict:
    """A replay mode's log-probs log p_S against the reference's full-vocabulary log p on the rows the loss reads:
    the smallest log p_S - log p (>= 0 up to the kernels' noise: renormalizing over a set that holds the label cannot
    lower its probability) and the mean kept mass exp(log p - log p_S), each set's full-vocabulary probability."""
    rise = replayed["log_probs"] - reference["log_probs"]
    return {"min_log_prob_rise": float(rise.min()), "mean_kept_mass": float(torch.exp(-rise).mean())}


def parity_note(reference_name: str, parity: dict | None) -> str:
    """What a mode's progress line says about its parity with the reference (or a replay mode's check)."""
    if parity is None:
        return ""
    if "min_log_prob_rise" in parity:
        return (
            f"; vs {reference_name} (full vocabulary): min log p_S - log p {parity['min_log_prob_rise']:.3g}, "
            f"mean kept mass {parity['mean_kept_mass']:.3g}"
        )
    return (
        f"; vs {reference_name}: log_probs {parity['log_probs']:.3g}, entropy {parity['entropy']:.3g}, loss "
        f"{parity['policy_loss']:.3g}, grads {parity['grads_max_abs']:.3g} (rel {parity['grads_rel']:.2g})"
    )


def markdown_table(report: dict) -> str:
    layout = report.get("layout", "thd")
    lines = [
        f"Training step and no-grad forward per mode ({layout}) {on_device(report)}, parity against the reference:",
        "",
        "| tokens (sequences) | mode | kernel | fwd+bwd time | fwd+bwd peak | no-grad fwd time | no-grad fwd peak |"
        " log-prob max_abs | entropy max_abs | loss max_abs | grad max_abs (rel) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    parity_key = PARITY_KEY[layout]
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
            replay = row.get(REPLAY_KEY)
            if replay is not None:
                cells = [
                    f"replay: min rise {replay['min_log_prob_rise']:.3g}, kept mass {replay['mean_kept_mass']:.3g}",
                    *["n/a (replay)"] * 3,
                ]
            elif parity is None:
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
    if any(REPLAY_KEY in row for size in report["sizes"] for row in size["modes"]):
        lines += ["", REPLAY_NOTE.format(**report["replay"])]
    return "\n".join(lines)
