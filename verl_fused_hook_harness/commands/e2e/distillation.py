"""`e2e-bench --distillation MODE`: one actor update with verl's `distillation_ppo_loss` through verl's
`forward_step`, verl's unfused path against hook mode.

Why: verl's Megatron engine computes on-policy distillation from a teacher's top-k (`forward_kl_topk`) only on
its unfused path: the [tokens, vocab] logits, a clone of them for the entropy, and its `_VocabParallelKLDivergence`
over fp32 log-softmax copies (its config notes an out-of-memory from about 64K tokens at a 152K vocabulary). Hook
mode computes the same outputs from hidden states (the op `token_log_probs`), and the single-sample estimators
inside the op with `output_processor_fused_loss=true`. Every mode goes the whole way verl's actor update does:
the build step, `forward_step(batch, model, distillation_ppo_loss, postprocess)`, verl's postprocess (loss and
metrics), the backward of the scaled loss.

Modes: `verl-unfused` (use_fused_kernels=False: verl's logits processor; the reference), `hook+ours+mask` (hook
mode), `hook+ours+fused-loss` (hook mode, the loss inside the op where it fuses: the estimators; forward_kl_topk
runs the two-pass path and says so), `legacy` (verl's legacy fused forward: the estimators run, forward_kl_topk
stops with verl's KeyError, reported in the table).

The batch is `--fused-loss`'s (e2e-bench's sequences, old and reference log-probs from a forward-only step, GRPO
advantages) plus a teacher's top-k nested like the input ids (support/distillation.py: ids over the whole
vocabulary, repeated ids, log-probs below the clamp) and the trainer's distillation flags. The loss: verl's
config through its Hydra config, supervised (`use_policy_gradient=False`; k1 and kl only as policy gradient, as
verl requires) with the task's ppo_loss, verl's dataclass clamps (log_prob_min_clamp -10, loss_max_clamp 10).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from verl_fused_hook.verl_integration.model_plan import counts_of

from ...support.compare import max_abs
from ...support.determinism import deterministic_steps
from ...support.distillation import TOPK, distillation_config, loss_function, nested_teacher, step_flags
from ...support.micro_batches import TEMPERATURE, e2e_rollout, forward_step_batch
from ...support.modes import Mode, kernel_backends
from ...support.reports import gib, ms, on_device, write_report
from ...support.verl_engine import UNFUSED, megatron_engine, reset_fused_mode
from .common import (
    Clock,
    Primed,
    build_model,
    free_step_memory,
    header_with_temperature,
    prepare_process,
    spread,
)
from .fused_loss import (
    LossStep,
    actor_batch,
    compare_loss,
    enable_loss_mode,
    grpo_actor_config,
    loss_snapshot,
    recorded_failure,
    sample_log_probs,
    time_loss_steps,
)

DISTILLATION_MODES = (
    Mode("verl-unfused", hook=False, kernel="unfused"),  # verl's logits processor over full logits: the reference
    Mode("hook+ours+mask", hook=True, kernel="ours", score_mask=True),
    Mode("hook+ours+fused-loss", hook=True, kernel="ours", score_mask=True, fused_loss=True),
    Mode("legacy", hook=False, kernel="verl"),  # verl's legacy fused forward (estimators only)
)
REFERENCE = "verl-unfused"
PARITY_KEY = "vs_verl_unfused"
LOSS_MODES = (TOPK, "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")  # verl 0.9.1's registered losses
POLICY_GRADIENT_ONLY = ("kl", "k1")  # verl refuses them as a supervised loss
CLAMPS = dict(log_prob_min_clamp=-10.0, loss_max_clamp=10.0)  # verl's DistillationLossConfig defaults


def distillation_setup(loss_mode: str, topk: int):
    """verl's DistillationConfig for the benchmark, and the fields the report records."""
    entries = dict(loss_mode=loss_mode, use_policy_gradient=loss_mode in POLICY_GRADIENT_ONLY, **CLAMPS)
    if loss_mode == TOPK:
        entries["topk"] = topk
    return distillation_config(**entries), entries


def distillation_engine(model, mode: Mode, backend: str | None, hf_path: str):
    options = {"output_processor_backend": backend, "output_processor_fused_loss": mode.fused_loss} if mode.hook else {}
    return megatron_engine(
        [model], fused_kernel_options=options, model_path=hf_path, use_fused_kernels=mode.kernel != "unfused"
    )


def enable_distillation_mode(model, engine, mode: Mode) -> str:
    """verl's unfused path (fused kernels off, nothing of ours on the model), or `--fused-loss`'s build step."""
    if mode.kernel == "unfused":
        reset_fused_mode(model)
        engine.engine_config.use_fused_kernels = False
        return UNFUSED
    return enable_loss_mode(model, engine, mode)


def distillation_batch(rollout, sampled: torch.Tensor, config, vocab_size: int, seed: int):
    """`--fused-loss`'s actor batch with the teacher's top-k and the trainer's distillation flags."""
    from verl.utils import tensordict_utils as tu

    data = actor_batch(rollout, sampled, seed)
    for key, value in nested_teacher(rollout[0], config, vocab_size, seed).items():
        data[key] = value
    tu.assign_non_tensor(data, **step_flags(config))
    return data


def distillation_snapshot(step: LossStep, report: dict) -> dict:
    """`--fused-loss`'s snapshot plus the per-token distillation loss on the rows verl's loss reads."""
    sample = loss_snapshot(step, report)
    losses = report["model_output"].get("distillation_losses")
    sample["distillation_losses"] = None if losses is None else losses.values()[step.read_rows].detach().float()
    return sample


def compare_distillation(reference: dict, other: dict) -> dict:
    rows = compare_loss(reference, other)
    want, got = reference["distillation_losses"], other["distillation_losses"]
    rows["distillation_losses"] = None if want is None else max_abs(want, got)
    return rows


def markdown_table(report: dict) -> str:
    lines = [
        f"Distillation step (forward, loss, backward) per mode {on_device(report)}, parity against verl-unfused:",
        "",
        "| tokens (sequences) | mode | kernel | fwd+loss+bwd time | vs verl-unfused | peak | loss | loss rel | worst "
        "metric rel | per-token KL max_abs | log-prob max_abs | grad max_abs (rel) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in report["sizes"]:
        label = f"{size['tokens']:,} ({len(size['sequence_lengths'])})"
        base = next((row.get("train_s") for row in size["modes"] if row["mode"] == REFERENCE), None)
        for row in size["modes"]:
            if "train_s" not in row:
                failure = "OOM" if row.get("oom") else f"error: {row.get('error', '?')}"
                lines.append(f"| {label} | {row['mode']} | {row['kernel']} | {failure} |" + " |" * 8)
                continue
            speed = f"{row['train_s'] / base:.2f}x" if base else ""
            parity = row.get(PARITY_KEY)
            if parity is None:
                cells = [f"{row['loss']:.6g}", *["reference"] * 5]
            else:
                kl = parity["distillation_losses"]
                cells = [
                    f"{parity['loss']:.6g}",
                    f"{parity['loss_rel']:.2g}",
                    f"{parity['metrics_rel']:.2g} ({parity['worst_metric']})",
                    "" if kl is None else f"{kl:.3g}",
                    f"{parity['log_probs']:.3g}",
                    f"{parity['grads_max_abs']:.3g} ({parity['grads_rel']:.2g})",
                ]
            lines.append(
                f"| {label} | {row['mode']} | {row['kernel']} | {ms(row['train_s'])}{spread(row.get('train_times_s'))}"
                f" | {speed} | {gib(row['train_peak_bytes'])} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def _prime(step: LossStep, row: dict, repeatable, args, reference) -> dict:
    """The parity sample (first warm-up, inside `repeatable()`), the other warm-ups; the row counts the
    micro-batches whose loss ran inside the op."""
    model = step.model
    calls_before = counts_of(model).fused_loss_forwards
    free_step_memory(model)
    with repeatable():
        sample = distillation_snapshot(step, step.train())
    row["loss"], row["metrics"] = float(sample["policy_loss"]), sample["metrics"]
    if reference is not None:
        row[PARITY_KEY] = compare_distillation(reference, sample)
    for _ in range(args.warmups - 1):
        free_step_memory(model)
        step.train()
    row["fused_loss_calls"] = counts_of(model).fused_loss_forwards - calls_before
    return sample


def run_distillation(args) -> dict:
    """Per size: the actor batch with the teacher's top-k, then every chosen mode against verl's unfused path."""
    device = args.device
    kernels = kernel_backends(device) | {"unfused": "unfused"}
    hf_config = prepare_process(args)
    config, entries = distillation_setup(args.distillation, args.topk)
    distillation_loss = loss_function(grpo_actor_config(), config)
    model = build_model(args, hf_config)
    modes = [mode for mode in DISTILLATION_MODES if mode.name in args.modes]
    engines = {
        mode.name: distillation_engine(model, mode, kernels[mode.kernel] if mode.hook else None, args.hf_config)
        for mode in modes
    }
    sampling_mode = DISTILLATION_MODES[1]  # old and reference log-probs: hook mode's forward-only step
    sampler = distillation_engine(model, sampling_mode, kernels["ours"], args.hf_config)
    clock = Clock(device)
    repeatable = functools.partial(deterministic_steps, model) if device == "cuda" else contextlib.nullcontext
    report = header_with_temperature(args, model, distillation=entries) | {"kernels": kernels, "sizes": []}
    for tokens in args.sizes:
        rollout = e2e_rollout(hf_config.vocab_size, tokens, device, args.seed)
        entry = {"tokens": tokens, "sequence_lengths": rollout[4], "modes": []}
        report["sizes"].append(entry)
        enable_distillation_mode(model, sampler, sampling_mode)
        forward_data = forward_step_batch(rollout[0], rollout[1]["prompts"], rollout[1]["responses"], TEMPERATURE)
        sampled = sample_log_probs(sampler, model, forward_data)
        data = distillation_batch(rollout, sampled, config, hf_config.vocab_size, args.seed)
        del forward_data, sampled
        reference, primed = None, []
        for mode in modes:
            row = {"mode": mode.name, "kernel": kernels[mode.kernel], "fused_loss": mode.fused_loss}
            entry["modes"].append(row)
            with recorded_failure(model, tokens, row):
                row["resolved"] = enable_distillation_mode(model, engines[mode.name], mode)
                step = LossStep(model, engines[mode.name], data, distillation_loss, mode, device, kernels["ours"])
                sample = _prime(step, row, repeatable, args, reference)
                if mode.name == REFERENCE:
                    reference = sample
                print(f"[{tokens}] {mode.name:<21} warmed up", flush=True)
                switch = functools.partial(enable_distillation_mode, model, engines[mode.name], mode)
                primed.append(Primed(step, row, switch, {"train": step.train}))
                del step, sample
        time_loss_steps(model, tokens, primed, clock, args.repeats)
        del primed, data
        reference = None
        free_step_memory(model)
        write_report(report, args.out, "e2e_distillation", markdown_table)  # after every size
    reset_fused_mode(model)
    return report
