"""`e2e-bench --fused-loss`: one actor update through verl's `forward_step` with `ppo_loss`, fused loss off against on.

Why a separate module: e2e-bench's THD modes use their own GRPO-style loss on
the engine forward's output; `output_processor_fused_loss` only acts inside
verl's `MegatronEngineWithLMHead.forward_step` when its loss function is
verl's `ppo_loss`. So every mode here goes the whole way verl's actor update
does: the build step, `forward_step(batch, model, ppo_loss, postprocess)`,
verl's postprocess (loss and metrics), then backward of the scaled loss.

The batch is e2e-bench's (same sequences, THD), completed as verl's actor
update hands it over: loss/response masks, per-sequence temperature, GRPO
advantages per token, old and reference log-probs (the model's own log-probs
from a forward-only `forward_step`, as verl's compute_log_prob gives them,
plus small fixed noise so ratios and the KL term are not trivially 1 and 0)
and verl's global-batch info. The loss is a GRPO-like `ActorConfig`: vanilla
clipped loss, token-mean, entropy bonus, low-var KL against the reference.
Each mode's parity step and warm-ups run first; the timed steps then go in
rounds over the modes (common.time_in_rounds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import traceback

import torch

from verl_fused_hook.verl_integration.loss_support import unsupported_reason
from verl_fused_hook.verl_integration.model_plan import counts_of, plan_of

from ...stand_ins.legacy_kernel_swap import portable_legacy_kernel_on_cpu
from ...support.compare import relative_scalar
from ...support.determinism import deterministic_steps
from ...support.micro_batches import TEMPERATURE, e2e_rollout, forward_step_batch, jagged, response_rows
from ...support.modes import Mode, kernel_backends
from ...support.reports import gib, ms, on_device, write_report
from ...support.verl_engine import megatron_engine, reset_fused_mode
from .common import (
    Clock,
    Primed,
    build_model,
    free_step_memory,
    header_with_temperature,
    mark_out_of_memory,
    prepare_process,
    snapshot_gradients,
    spread,
    time_in_rounds,
)
from .thd import compare_samples, enable_mode

LOSS_MODES = (
    Mode("hook+ours+mask", hook=True, kernel="ours", score_mask=True),  # two-pass: log-probs, then ppo_loss
    Mode("hook+ours+fused-loss", hook=True, kernel="ours", score_mask=True, fused_loss=True),  # ppo_loss in the op
    Mode("legacy", hook=False, kernel="verl"),  # verl as it ships with the switch at 0: the time reference
)
TWO_PASS = "hook+ours+mask"
PARITY_KEY = "vs_two_pass"

ENTROPY_COEFF = 0.01
KL_LOSS_COEF = 0.001
OLD_LOG_PROB_NOISE = 0.15  # ratios outside the 0.2 clip range on about a fifth of the tokens
REF_LOG_PROB_NOISE = 0.1


POLICY_LOSSES = ("vanilla", "gspo", "sft")
# GSPO as its paper trains it: sequence-level ratio, seq-mean-token-mean, a clip range of 3e-4 / 4e-4.
GSPO_FIELDS = dict(loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4)


def grpo_actor_config(policy_loss: str = "vanilla"):
    """verl's ActorConfig for a GRPO-like update (vanilla clipped loss or GSPO); refused at start-up if the fused
    loss would not take it."""
    from verl.workers.config import ActorConfig  # verl loads on first use (`import verl` starts ray)

    base = ActorConfig(strategy="megatron", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    fields = dict(
        loss_agg_mode="token-mean",
        entropy_coeff=ENTROPY_COEFF,
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        kl_loss_coef=KL_LOSS_COEF,
    )
    config = dataclasses.replace(base, **(fields | (GSPO_FIELDS if policy_loss == "gspo" else {})))
    config = dataclasses.replace(config, policy_loss=dataclasses.replace(config.policy_loss, loss_mode=policy_loss))
    reason = unsupported_reason(config)
    if reason is not None:
        raise RuntimeError(f"the benchmark's ActorConfig would not be fused: {reason}")
    return config


def loss_function_and_fields(policy_loss: str):
    """verl's loss function for the benchmark's `--policy-loss`, and the config fields the report records."""
    import verl.workers.utils.losses as verl_losses

    if policy_loss == "sft":
        return functools.partial(verl_losses.sft_loss, config=None), {"loss": "sft_loss"}
    config = grpo_actor_config(policy_loss)
    fields = dict(
        loss_mode=policy_loss,
        loss_agg_mode=config.loss_agg_mode,
        clip_ratio=config.clip_ratio,
        clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high,
        entropy_coeff=config.entropy_coeff,
        use_kl_loss=config.use_kl_loss,
        kl_loss_type=config.kl_loss_type,
        kl_loss_coef=config.kl_loss_coef,
    )
    return functools.partial(verl_losses.ppo_loss, config=config), fields


def loss_engine(model, mode: Mode, backend: str | None, hf_path: str):
    options = {"output_processor_backend": backend, "output_processor_fused_loss": mode.fused_loss} if mode.hook else {}
    return megatron_engine([model], fused_kernel_options=options, model_path=hf_path)


def enable_loss_mode(model, engine, mode: Mode) -> str:
    """thd.py's build step, then a check that the plan fuses the loss exactly when the mode says so."""
    resolved = enable_mode(model, engine, mode)
    if mode.hook and plan_of(model).fused_loss != mode.fused_loss:
        raise RuntimeError(
            f"mode {mode.name}: the plan's fused_loss is {plan_of(model).fused_loss}, expected {mode.fused_loss}"
        )
    return resolved


# ---------------------------------------------------------------- the actor batch


def actor_batch(rollout, sampled_log_probs: torch.Tensor, seed: int, sft: bool = False):
    """The actor update's micro-batch: forward_step's fields plus what ppo_loss reads (padded [batch, response]
    inputs cut back to each response's length) and verl's global-batch info for one data-parallel rank; for
    sft_loss the same batch without entropy (its loss mask covers the responses)."""
    input_ids, data, advantages, _, _ = rollout
    response_lens = data["responses"].offsets().diff().tolist()
    width = sampled_log_probs.shape[1]
    generator = torch.Generator().manual_seed(seed + 11)
    old_noise = OLD_LOG_PROB_NOISE * torch.randn(sampled_log_probs.shape, generator=generator)
    ref_noise = REF_LOG_PROB_NOISE * torch.randn(sampled_log_probs.shape, generator=generator)

    def per_response(padded: torch.Tensor):
        return jagged(row[:n] for row, n in zip(padded.float(), response_lens))

    ppo_fields = {
        "response_mask": per_response(torch.ones_like(sampled_log_probs)).long(),
        "old_log_probs": per_response(sampled_log_probs + old_noise.to(sampled_log_probs.device)),
        "ref_log_prob": per_response(sampled_log_probs + ref_noise.to(sampled_log_probs.device)),
        "advantages": per_response(advantages.unsqueeze(1).expand(-1, width)),  # GRPO: one advantage per sequence
    }
    return forward_step_batch(
        input_ids,
        data["prompts"],
        data["responses"],
        TEMPERATURE,
        extra_fields=ppo_fields,
        dp_size=1,
        batch_num_tokens=sum(response_lens),
        global_batch_size=len(response_lens),
        num_micro_batch=1,
        calculate_entropy=not sft,
    )


def sample_log_probs(engine, model, data) -> torch.Tensor:
    """The model's log-probs of the responses, [batch, response] padded, through a forward-only forward_step."""
    from verl.workers.utils.padding import no_padding_2_padding

    postprocess = functools.partial(engine.postprocess_micro_batch_func, forward_only=True, loss_function=None)
    with torch.no_grad():
        output, finish = engine.forward_step(iter([data]), model, None, postprocess)
        _, report = finish(output)
    return no_padding_2_padding(report["model_output"]["log_probs"], data).float()


# ---------------------------------------------------------------- one step


class LossStep:
    """verl's forward_step with ppo_loss, its postprocess and the backward of the scaled loss."""

    def __init__(self, model, engine, data, loss_function, mode: Mode, device: str, cpu_kernel: str):
        self.model, self.engine, self.data, self.mode = model, engine, data, mode
        self.loss_function = loss_function
        # On the CPU verl's Triton kernel cannot run: the legacy forward gets the portable op.
        self.kernel_context = (
            contextlib.nullcontext
            if mode.hook
            else functools.partial(portable_legacy_kernel_on_cpu, device, cpu_kernel)
        )
        self.read_rows = response_rows(data).values()  # the rows ppo_loss reads

    def train(self) -> dict:
        """Returns verl's report: {"loss": float, "metrics": {...}, "model_output": detached outputs}."""
        postprocess = functools.partial(
            self.engine.postprocess_micro_batch_func, forward_only=False, loss_function=self.loss_function
        )
        with self.kernel_context():
            output, finish = self.engine.forward_step(iter([self.data]), self.model, self.loss_function, postprocess)
            scaled_loss, report = finish(output)
            scaled_loss.backward()
        return report


def metric_values(metrics: dict) -> dict[str, float]:
    """verl's metrics as floats (a Metric aggregated as verl's trainer does)."""
    from verl.utils.metric import Metric

    return {key: float(value.aggregate() if isinstance(value, Metric) else value) for key, value in metrics.items()}


def loss_snapshot(step: LossStep, report: dict) -> dict:
    outputs = report["model_output"]
    entropy = outputs.get("entropy")  # sft_loss: not computed
    return {
        "log_probs": outputs["log_probs"].values()[step.read_rows].detach().float(),
        "entropy": None if entropy is None else entropy.values()[step.read_rows].detach().float(),
        "policy_loss": torch.tensor([report["loss"]], dtype=torch.float64),
        "metrics": metric_values(report["metrics"]),
        "grads": snapshot_gradients(step.model),
    }


def compare_loss(reference: dict, other: dict) -> dict:
    """thd.py's comparison (log-probs, entropy, loss max_abs, worst gradient) plus the loss's relative error
    and every metric verl reports: both values and the relative error, and the worst of them."""
    rows = compare_samples(reference, other)
    if reference["metrics"].keys() != other["metrics"].keys():
        raise RuntimeError(f"metric sets differ: {sorted(reference['metrics'].keys() ^ other['metrics'].keys())}")
    loss_ref, loss = float(reference["policy_loss"]), float(other["policy_loss"])
    rows["loss"], rows["loss_reference"], rows["loss_rel"] = loss, loss_ref, relative_scalar(loss_ref, loss)
    rows["metrics"] = {
        key: {"reference": value, "value": other["metrics"][key], "rel": relative_scalar(value, other["metrics"][key])}
        for key, value in reference["metrics"].items()
    }
    worst = max(rows["metrics"], key=lambda key: rows["metrics"][key]["rel"], default=None)  # sft_loss: no metrics
    rows["metrics_rel"], rows["worst_metric"] = (0.0, None) if worst is None else (rows["metrics"][worst]["rel"], worst)
    return rows


# ---------------------------------------------------------------- report


def markdown_table(report: dict) -> str:
    lines = [
        f"Policy-loss step (forward, loss, backward) per mode {on_device(report)}, parity against the two-pass op:",
        "",
        "| tokens (sequences) | mode | kernel | fwd+loss+bwd time | vs two-pass | peak | loss | loss rel | worst "
        "metric rel |"
        " log-prob max_abs | grad max_abs (rel) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in report["sizes"]:
        label = f"{size['tokens']:,} ({len(size['sequence_lengths'])})"
        rows = {row["mode"]: row for row in size["modes"]}
        base = rows.get(TWO_PASS, {}).get("train_s")
        for row in size["modes"]:
            if "train_s" not in row:
                failure = "OOM" if row.get("oom") else f"error: {row.get('error', '?')}"
                lines.append(f"| {label} | {row['mode']} | {row['kernel']} | {failure} | | | | | | | |")
                continue
            speed = f"{row['train_s'] / base:.2f}x" if base else ""
            parity = row.get(PARITY_KEY)
            if parity is None:
                cells = [f"{row['loss']:.6g}", "reference", "reference", "reference", "reference"]
            else:
                cells = [
                    f"{parity['loss']:.6g}",
                    f"{parity['loss_rel']:.2g}",
                    f"{parity['metrics_rel']:.2g} ({parity['worst_metric']})",
                    f"{parity['log_probs']:.3g}",
                    f"{parity['grads_max_abs']:.3g} ({parity['grads_rel']:.2g})",
                ]
            lines.append(
                f"| {label} | {row['mode']} | {row['kernel']} | "
                f"{ms(row['train_s'])}{spread(row.get('train_times_s'))} | {speed} "
                f"| {gib(row['train_peak_bytes'])} | " + " | ".join(cells) + " |"
            )
        floor = size.get("two_pass_rerun")
        if floor is not None:
            lines.append(
                f"| {label} | two-pass rerun | (repeatability) | | | | {floor['loss']:.6g} | {floor['loss_rel']:.2g} "
                f"| {floor['metrics_rel']:.2g} ({floor['worst_metric']}) | {floor['log_probs']:.3g} "
                f"| {floor['grads_max_abs']:.3g} ({floor['grads_rel']:.2g}) |"
            )
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def prime_loss_mode(step: LossStep, row: dict, entry: dict, repeatable, args, reference) -> dict:
    """Parity sample (first warm-up, inside `repeatable()`) and further warm-ups of one mode; returns the sample.
    The row counts the micro-batches whose ppo_loss ran inside the op (the plugin's own count; the timed steps
    add theirs)."""
    model = step.model
    calls_before = counts_of(model).fused_loss_forwards
    free_step_memory(model)
    with repeatable():
        sample = loss_snapshot(step, step.train())
    row["loss"] = float(sample["policy_loss"])
    row["metrics"] = sample["metrics"]
    if step.mode.name == TWO_PASS and args.device == "cuda":
        free_step_memory(model)
        with repeatable():
            entry["two_pass_rerun"] = compare_loss(sample, loss_snapshot(step, step.train()))
    elif reference is not None:
        row[PARITY_KEY] = compare_loss(reference, sample)
    for _ in range(args.warmups - 1):
        free_step_memory(model)
        step.train()
    row["fused_loss_calls"] = counts_of(model).fused_loss_forwards - calls_before
    return sample


@contextlib.contextmanager
def recorded_failure(model, tokens: int, row: dict):
    """Prime one mode; its out-of-memory or error goes into its row (the table and the log) and the other modes
    still run. Frees the step's memory either way."""
    try:
        yield
    except torch.OutOfMemoryError:
        mark_out_of_memory(model, tokens, row, 21)
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {error}"[:300]
        traceback.print_exc()
    free_step_memory(model)


def time_loss_steps(model, tokens: int, primed: list, clock, repeats: int) -> None:
    """Time the primed modes' training steps in rounds (with the loss-inside op's call count) and print each one's
    time, peak and loss."""
    time_in_rounds(
        primed,
        clock,
        repeats,
        {"train": functools.partial(free_step_memory, model)},
        lambda p: mark_out_of_memory(model, tokens, p.row, 21),
        ("fused_loss_calls", lambda: counts_of(model).fused_loss_forwards),
    )
    free_step_memory(model)
    for row in (p.row for p in primed):
        if "train_s" in row:
            print(
                f"[{tokens}] {row['mode']:<21} fwd+loss+bwd {ms(row['train_s'])} peak "
                f"{gib(row['train_peak_bytes'])} loss {row['loss']:.6g}",
                flush=True,
            )


def _parity_note(parity: dict | None) -> str:
    if parity is None:
        return ""
    return (
        f"; vs two-pass: loss rel {parity['loss_rel']:.2g}, worst metric rel {parity['metrics_rel']:.2g} "
        f"({parity['worst_metric']}), grads {parity['grads_max_abs']:.3g} (rel {parity['grads_rel']:.2g})"
    )


def run_fused_loss(args) -> dict:
    """Per size: the actor batch (old/ref log-probs from a forward-only step), then every chosen mode."""
    device = args.device
    kernels = kernel_backends(device)
    hf_config = prepare_process(args)
    loss_function, actor_config = loss_function_and_fields(args.policy_loss)
    model = build_model(args, hf_config)
    modes = [mode for mode in LOSS_MODES if mode.name in args.modes]
    engines = {
        mode.name: loss_engine(model, mode, kernels[mode.kernel] if mode.hook else None, args.hf_config)
        for mode in modes
    }
    by_name = {mode.name: mode for mode in modes}
    clock = Clock(device)
    repeatable = functools.partial(deterministic_steps, model) if device == "cuda" else contextlib.nullcontext
    report = header_with_temperature(args, model, actor_config=actor_config) | {"kernels": kernels, "sizes": []}
    for tokens in args.sizes:
        rollout = e2e_rollout(hf_config.vocab_size, tokens, device, args.seed)
        entry = {"tokens": tokens, "sequence_lengths": rollout[4], "modes": []}
        report["sizes"].append(entry)
        enable_loss_mode(model, engines[TWO_PASS], by_name[TWO_PASS])
        input_ids, data = rollout[0], rollout[1]
        forward_data = forward_step_batch(input_ids, data["prompts"], data["responses"], TEMPERATURE)
        sampled = sample_log_probs(engines[TWO_PASS], model, forward_data)
        data = actor_batch(rollout, sampled, args.seed, sft=args.policy_loss == "sft")
        del forward_data, sampled
        reference, primed = None, []
        for mode in modes:
            row = {"mode": mode.name, "kernel": kernels[mode.kernel], "fused_loss": mode.fused_loss}
            entry["modes"].append(row)
            with recorded_failure(model, tokens, row):
                row["resolved"] = enable_loss_mode(model, engines[mode.name], mode)
                step = LossStep(model, engines[mode.name], data, loss_function, mode, device, kernels["ours"])
                sample = prime_loss_mode(step, row, entry, repeatable, args, reference)
                if mode.name == TWO_PASS:
                    reference = sample
                print(f"[{tokens}] {mode.name:<21} warmed up{_parity_note(row.get(PARITY_KEY))}", flush=True)
                switch = functools.partial(enable_loss_mode, model, engines[mode.name], mode)
                primed.append(Primed(step, row, switch, {"train": step.train}))
                del step, sample
        time_loss_steps(model, tokens, primed, clock, args.repeats)
        del primed
        reference = None
        del data
        free_step_memory(model)
        write_report(
            report, args.out, "e2e_fused_loss", markdown_table
        )  # after every size: a cut-off run keeps its sizes
    reset_fused_mode(model)
    return report
