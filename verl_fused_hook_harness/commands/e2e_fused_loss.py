"""`e2e-bench --fused-loss`: one actor update through verl's `forward_step` with `ppo_loss`, fused loss off against on.

Why a separate module: e2e_bench's THD modes use their own GRPO-style loss on
the engine forward's output; `output_processor_fused_loss` only acts inside
verl's `MegatronEngineWithLMHead.forward_step` when its loss function is
verl's `ppo_loss`. So every mode here goes the whole way verl's actor update
does: the build step, `forward_step(batch, model, ppo_loss, postprocess)`,
verl's postprocess (loss and metrics), then backward of the scaled loss.

The batch is e2e_bench's (same sequences, THD), completed as verl's actor
update hands it over: loss/response masks, per-sequence temperature, GRPO
advantages per token, old and reference log-probs (the model's own log-probs
from a forward-only `forward_step`, as verl's compute_log_prob gives them,
plus small fixed noise so ratios and the KL term are not trivially 1 and 0)
and verl's global-batch info. The loss is a GRPO-like `ActorConfig`: vanilla
clipped loss, token-mean, entropy bonus, low-var KL against the reference.
"""

from __future__ import annotations

import contextlib
import functools
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

from .ab_parity import TEMPERATURE
from .e2e_bench import (
    Clock,
    Mode,
    _gib,
    _ms,
    compare,
    enable_mode,
    free_step_memory,
    init_single_process,
    make_batch,
    reset_fused_mode,
    write_report,
)


@dataclass(frozen=True)
class LossMode(Mode):
    fused_loss: bool = False  # fused_kernel_options.output_processor_fused_loss


LOSS_MODES = (
    LossMode("hook+ours+mask", hook=True, kernel="ours", masked=True),  # two-pass: log-probs, then ppo_loss
    LossMode("hook+ours+fused-loss", hook=True, kernel="ours", masked=True, fused_loss=True),  # ppo_loss in the op
    LossMode("legacy", hook=False, kernel="verl"),  # verl as it ships with the switch at 0: the time reference
)
TWO_PASS = "hook+ours+mask"
PARITY_KEY = "vs_two_pass"

ENTROPY_COEFF = 0.01
KL_LOSS_COEF = 0.001
OLD_LOG_PROB_NOISE = 0.15  # ratios outside the 0.2 clip range on about a fifth of the tokens
REF_LOG_PROB_NOISE = 0.1


def grpo_actor_config():
    """verl's ActorConfig for a GRPO-like update; refused at start-up if the fused loss would not take it."""
    import dataclasses

    from verl.workers.config import ActorConfig

    from verl_fused_hook.verl_integration.ppo_loss import unsupported_reason

    base = ActorConfig(strategy="megatron", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    config = dataclasses.replace(
        base, loss_agg_mode="token-mean", entropy_coeff=ENTROPY_COEFF, use_kl_loss=True, kl_loss_type="low_var_kl",
        kl_loss_coef=KL_LOSS_COEF,
    )
    reason = unsupported_reason(config)
    if reason is not None:
        raise RuntimeError(f"the benchmark's ActorConfig would not be fused: {reason}")
    return config


def loss_engine(model, mode: LossMode, backend: str | None, hf_path: str):
    from verl_fused_hook_harness.support.verl_engine import megatron_engine

    options = {"output_processor_backend": backend, "output_processor_fused_loss": mode.fused_loss} if mode.hook else {}
    return megatron_engine([model], fused_kernel_options=options, model_path=hf_path)


def enable_loss_mode(model, engine, mode: LossMode) -> str:
    """e2e_bench's build step, then a check that the plan fuses the loss exactly when the mode says so."""
    from verl_fused_hook.verl_integration.model_plan import plan_of

    resolved = enable_mode(model, engine, mode)
    if mode.hook and plan_of(model).fused_loss != mode.fused_loss:
        raise RuntimeError(f"mode {mode.name}: the plan's fused_loss is {plan_of(model).fused_loss}, expected {mode.fused_loss}")
    return resolved


# ---------------------------------------------------------------- the actor batch


def _jagged(parts):
    return torch.nested.as_nested_tensor(list(parts), layout=torch.jagged)


def forward_batch(base, device: str):
    """What forward_step needs for a forward-only pass (verl's compute_log_prob): ids, loss mask, temperatures."""
    from verl.utils import tensordict_utils as tu

    input_ids, data, _, _, _ = base
    prompts, responses = data["prompts"], data["responses"]
    loss_mask = [torch.cat([torch.zeros_like(p), torch.ones_like(r)]) for p, r in zip(prompts.unbind(), responses.unbind())]
    tensors = {
        "input_ids": input_ids,
        "prompts": prompts,
        "responses": responses,
        "loss_mask": _jagged(loss_mask),
        "temperature": torch.full((input_ids.shape[0],), TEMPERATURE, device=device),
    }
    return tensors, tu.get_tensordict(tensors, non_tensor_dict={"calculate_entropy": True})


def actor_batch(base, tensors: dict, sampled_log_probs: torch.Tensor, seed: int):
    """The actor update's micro-batch: `tensors` plus what ppo_loss reads (padded [batch, response] inputs
    cut back to each response's length) and verl's global-batch info for one data-parallel rank."""
    from verl.utils import tensordict_utils as tu

    _, data, advantages, _, _ = base
    response_lens = data["responses"].offsets().diff().tolist()
    width = sampled_log_probs.shape[1]
    generator = torch.Generator().manual_seed(seed + 11)
    old_noise = OLD_LOG_PROB_NOISE * torch.randn(sampled_log_probs.shape, generator=generator)
    ref_noise = REF_LOG_PROB_NOISE * torch.randn(sampled_log_probs.shape, generator=generator)

    def per_response(padded: torch.Tensor):
        return _jagged(row[:n] for row, n in zip(padded.float(), response_lens))

    fields = {
        "response_mask": per_response(torch.ones_like(sampled_log_probs)).long(),
        "old_log_probs": per_response(sampled_log_probs + old_noise.to(sampled_log_probs.device)),
        "ref_log_prob": per_response(sampled_log_probs + ref_noise.to(sampled_log_probs.device)),
        "advantages": per_response(advantages.unsqueeze(1).expand(-1, width)),  # GRPO: one advantage per sequence
    }
    batch_info = dict(dp_size=1, batch_num_tokens=sum(response_lens), global_batch_size=len(response_lens))
    return tu.get_tensordict(
        {**tensors, **fields}, non_tensor_dict={**batch_info, "calculate_entropy": True, "num_micro_batch": 1}
    )


def _kernel_context(mode: LossMode, device: str, cpu_kernel: str):
    """On the CPU verl's Triton kernel cannot run: the legacy forward gets the portable op (as in e2e_bench)."""
    if device == "cpu" and not mode.hook:
        from verl_fused_hook_harness.stand_ins.legacy_kernel_swap import portable_legacy_kernel

        return portable_legacy_kernel(cpu_kernel)
    return contextlib.nullcontext()


def sample_log_probs(engine, model, data, context) -> torch.Tensor:
    """The model's log-probs of the responses, [batch, response] padded, through a forward-only forward_step."""
    from verl.workers.utils.padding import no_padding_2_padding

    postprocess = functools.partial(engine.postprocess_micro_batch_func, forward_only=True, loss_function=None)
    with torch.no_grad(), context:
        output, finish = engine.forward_step(iter([data]), model, None, postprocess)
        _, report = finish(output)
    return no_padding_2_padding(report["model_output"]["log_probs"], data).float()


# ---------------------------------------------------------------- one step


class LossStep:
    """verl's forward_step with ppo_loss, its postprocess and the backward of the scaled loss."""

    def __init__(self, model, engine, data, loss_function, mode: LossMode, device: str, cpu_kernel: str):
        from verl_fused_hook.verl_integration.forward_step import response_score_rows

        self.model, self.engine, self.data, self.mode = model, engine, data, mode
        self.loss_function = loss_function
        self.context = functools.partial(_kernel_context, mode, device, cpu_kernel)
        self.read_rows = response_score_rows(data, None).values()  # the rows ppo_loss reads

    def train(self) -> dict:
        """Returns verl's report: {"loss": float, "metrics": {...}, "model_output": detached outputs}."""
        postprocess = functools.partial(
            self.engine.postprocess_micro_batch_func, forward_only=False, loss_function=self.loss_function
        )
        with self.context():
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
    return {
        "log_probs": outputs["log_probs"].values()[step.read_rows].detach().float(),
        "entropy": outputs["entropy"].values()[step.read_rows].detach().float(),
        "policy_loss": torch.tensor([report["loss"]], dtype=torch.float64),
        "metrics": metric_values(report["metrics"]),
        "grads": {name: p.grad.detach().clone() for name, p in step.model.named_parameters() if p.grad is not None},
    }


def _relative(reference: float, value: float) -> float:
    return abs(value - reference) / abs(reference) if reference != 0 else abs(value)


def compare_loss(reference: dict, other: dict) -> dict:
    """e2e_bench's comparison (log-probs, entropy, loss max_abs, worst gradient) plus the loss's relative error
    and every metric verl reports: both values and the relative error, and the worst of them."""
    rows = compare(reference, other)
    if reference["metrics"].keys() != other["metrics"].keys():
        raise RuntimeError(f"metric sets differ: {sorted(reference['metrics'].keys() ^ other['metrics'].keys())}")
    loss_ref, loss = float(reference["policy_loss"]), float(other["policy_loss"])
    rows["loss"], rows["loss_reference"], rows["loss_rel"] = loss, loss_ref, _relative(loss_ref, loss)
    rows["metrics"] = {
        key: {"reference": value, "value": other["metrics"][key], "rel": _relative(value, other["metrics"][key])}
        for key, value in reference["metrics"].items()
    }
    worst = max(rows["metrics"], key=lambda key: rows["metrics"][key]["rel"])
    rows["metrics_rel"], rows["worst_metric"] = rows["metrics"][worst]["rel"], worst
    return rows


# ---------------------------------------------------------------- report


def markdown_table(report: dict) -> str:
    lines = [
        "| tokens (sequences) | mode | kernel | fwd+loss+bwd time | vs two-pass | peak | loss | loss rel | worst metric rel |"
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
                f"| {label} | {row['mode']} | {row['kernel']} | {_ms(row['train_s'])} | {speed} "
                f"| {_gib(row['train_peak_bytes'])} | " + " | ".join(cells) + " |"
            )
        floor = size.get("two_pass_rerun")
        if floor is not None:
            lines.append(
                f"| {label} | two-pass rerun | (repeatability) | | | | {floor['loss']:.6g} | {floor['loss_rel']:.2g} "
                f"| {floor['metrics_rel']:.2g} ({floor['worst_metric']}) | {floor['log_probs']:.3g} "
                f"| {floor['grads_max_abs']:.3g} ({floor['grads_rel']:.2g}) |"
            )
    return "\n".join(lines)


def write_outputs(report: dict, out: Path | None) -> None:
    write_report(report, out, "e2e_fused_loss", markdown_table)


# ---------------------------------------------------------------- main


def measure_loss_mode(step: LossStep, row: dict, entry: dict, repeatable, clock: Clock, args, reference) -> dict:
    """Parity sample (first warm-up, inside `repeatable()`), further warm-ups, timed steps; returns the sample."""
    model = step.model
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
    row["train_s"], row["train_peak_bytes"], row["train_peak_abs_bytes"] = clock.measure(
        step.train, args.repeats, functools.partial(free_step_memory, model)
    )
    return sample


def run_fused_loss(args) -> dict:
    """Per size: the actor batch (old/ref log-probs from a forward-only step), then every chosen mode."""
    import verl.workers.utils.losses as verl_losses

    from verl_fused_hook_harness.support.determinism import deterministic_steps, prepare_cublas_workspace
    from verl_fused_hook_harness.support.hf_model import build_gpt_from_hf, load_hf_config
    from verl_fused_hook.verl_integration import install

    device = args.device
    kernels = {"verl": "verl", "ours": "triton"} if device == "cuda" else {"verl": "torch", "ours": "torch"}
    install()  # what `import verl` does through the entry point when the package is installed
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401  (fires the plugin's build gate)

    config = grpo_actor_config()
    loss_function = functools.partial(verl_losses.ppo_loss, config=config)
    if device == "cuda":
        prepare_cublas_workspace()  # before the first GEMM: the parity steps run deterministic
    init_single_process(device, args.seed)
    hf_config = load_hf_config(args.hf_config)
    started = time.time()
    model = build_gpt_from_hf(hf_config, dtype=args.dtype, seed=args.seed, cpu_initialization=args.cpu_init).to(device)
    print(f"model built in {time.time() - started:.1f}s: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B "
          f"parameters, {args.dtype}, hidden {hf_config.hidden_size}, vocab {hf_config.vocab_size}", flush=True)
    modes = [mode for mode in LOSS_MODES if mode.name in args.modes]
    engines = {
        mode.name: loss_engine(model, mode, kernels[mode.kernel] if mode.hook else None, args.hf_config) for mode in modes
    }
    by_name = {mode.name: mode for mode in modes}
    clock = Clock(device)
    repeatable = functools.partial(deterministic_steps, model) if device == "cuda" else contextlib.nullcontext
    report = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "hf_config": str(args.hf_config),
        "dtype": str(args.dtype),
        "temperature": TEMPERATURE,
        "actor_config": dict(
            loss_mode="vanilla", loss_agg_mode=config.loss_agg_mode, clip_ratio=config.clip_ratio,
            entropy_coeff=config.entropy_coeff, use_kl_loss=config.use_kl_loss, kl_loss_type=config.kl_loss_type,
            kl_loss_coef=config.kl_loss_coef,
        ),
        "warmups": args.warmups,
        "repeats": args.repeats,
        "kernels": kernels,
        "sizes": [],
    }
    for tokens in args.sizes:
        base = make_batch(hf_config.vocab_size, tokens, device, args.seed)
        entry = {"tokens": tokens, "sequence_lengths": base[4], "modes": []}
        report["sizes"].append(entry)
        two_pass = by_name[TWO_PASS]
        enable_loss_mode(model, engines[TWO_PASS], two_pass)
        tensors, forward_data = forward_batch(base, device)
        sampled = sample_log_probs(engines[TWO_PASS], model, forward_data, contextlib.nullcontext())
        data = actor_batch(base, tensors, sampled, args.seed)
        del forward_data, sampled
        reference = None
        for mode in modes:
            row = {"mode": mode.name, "kernel": kernels[mode.kernel], "fused_loss": mode.fused_loss}
            try:
                row["resolved"] = enable_loss_mode(model, engines[mode.name], mode)
                step = LossStep(model, engines[mode.name], data, loss_function, mode, device, kernels["ours"])
                sample = measure_loss_mode(step, row, entry, repeatable, clock, args, reference)
                if mode.name == TWO_PASS:
                    reference = sample
                del step, sample
            except torch.OutOfMemoryError:
                row["oom"] = True
                print(f"[{tokens}] {mode.name:<21} out of device memory", flush=True)
            except Exception as error:  # reported in the table and the log; the other modes still run
                row["error"] = f"{type(error).__name__}: {error}"[:300]
                traceback.print_exc()
            free_step_memory(model)
            entry["modes"].append(row)
            if "train_s" in row:
                parity = row.get(PARITY_KEY)
                note = "" if parity is None else (
                    f"; vs two-pass: loss rel {parity['loss_rel']:.2g}, worst metric rel {parity['metrics_rel']:.2g} "
                    f"({parity['worst_metric']}), grads {parity['grads_max_abs']:.3g} (rel {parity['grads_rel']:.2g})"
                )
                print(f"[{tokens}] {mode.name:<21} fwd+loss+bwd {_ms(row['train_s'])} peak "
                      f"{_gib(row['train_peak_bytes'])} loss {row['loss']:.6g}{note}", flush=True)
        reference = None
        del data
        free_step_memory(model)
        write_outputs(report, args.out)  # after every size, so a cut-off run keeps what it measured
    reset_fused_mode(model)
    return report

