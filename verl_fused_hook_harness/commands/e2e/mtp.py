"""End to end with MTP (`e2e-bench --mtp`): one actor micro-batch with MTP training, verl as it ships vs hook mode.

One process, one device, TP=1. A GPTModel from a Hugging Face config (default:
Qwen2.5-7B shapes, 2 layers) with one MTP layer and the vocabulary overridden
(default 248320, a Qwen3.5-style vocabulary). Per side and micro-batch size,
through verl's build step with `mtp.enable=True, enable_train=True`,
`patch_engine_mtp` and `forward_step` (support/mtp_engine.py), then a
GRPO-style loss over the response rows and its backward:

  verl   VERL_FUSED_USE_OP_HOOK unset: verl turns fused kernels off with MTP, so the
         main head and megatron's MTP loss build [tokens, vocab] logits
  hook   VERL_FUSED_USE_OP_HOOK=1: main head and MTP loss through the op (backend triton
         on CUDA, torch on the CPU)

Per row: median fwd+bwd time and peak memory above the weights and batch, or
OOM when the step ran out of device memory (recorded, not raised). Parity (hook
vs verl, where verl ran) on the first step: log-probs, entropy, loss, the logged
MTP loss, acceptance counts and every parameter gradient. Then one more step
with `HeadMemoryProbe` (head_memory.py): the output layer's own extra
memory inside that real step (main head plus MTP heads, from the MTP loss call
to the hidden states' gradient), beside the op's fp32 hidden-gradient
accumulator and the issue's target (1.5 GiB plus that accumulator).
"""

from __future__ import annotations

import functools
import time

import torch

from ...support.compare import differing_parameters, error, worst_gradient
from ...support.micro_batches import (
    TEMPERATURE,
    e2e_rollout,
    forward_step_batch,
    grpo_loss,
    response_rows,
    response_values,
)
from ...support.mtp_engine import build_mtp_engine, mtp_forward, take_mtp_metrics
from ...support.reports import gib, ms, on_device, write_report
from .common import (
    Clock,
    build_model,
    free_step_memory,
    model_fields,
    prepare_process,
    report_header,
    snapshot_gradients,
)
from .head_memory import HeadMemoryProbe

SIDES = ("hook", "verl")  # hook first: verl's side may run out of memory


def mtp_step(engine, model, batch, advantages, old_offset):
    output = mtp_forward(engine, model, batch)
    loss = grpo_loss(output["log_probs"], output["entropy"], batch, advantages, old_offset)
    loss.backward()
    return output, loss


def first_step_sample(model, batch, output, loss) -> dict:
    """The first step's results, on the CPU (so the other side's peak is not charged for them)."""
    return {
        "log_probs": response_values(output["log_probs"], batch).detach().float().cpu(),
        "entropy": response_values(output["entropy"], batch).detach().float().cpu(),
        "loss": loss.detach().float().cpu(),
        "mtp": take_mtp_metrics(),
        "grads": snapshot_gradients(model, to_cpu=True),
    }


def output_layer_memory(step, model, batch) -> dict:
    """One more step under `HeadMemoryProbe`; scored rows: the main head's (the response rows, what hook mode
    scores) and each MTP layer's (its rolled loss mask, megatron's logged total)."""
    free_step_memory(model)
    take_mtp_metrics()
    with HeadMemoryProbe(model.shared_embedding_or_output_weight()) as probe:
        step()
    totals = take_mtp_metrics()["total_values"]
    scored = {"main": int(response_rows(batch).values().sum())}
    scored.update({f"mtp{k + 1}": int(totals[k]) for k in range(model.config.mtp_num_layers)})
    result = probe.result(scored)
    free_step_memory(model)
    return result


def compare_sides(verl: dict, hook: dict) -> dict:
    """Hook vs verl, relative to verl's largest magnitude (gradients: of the parameters both sides hold);
    acceptance as absolute count differences."""
    shared = {name: grad for name, grad in verl["grads"].items() if name in hook["grads"]}
    grads_rel, worst_param = worst_gradient(shared, hook["grads"], relative=True) if shared else (float("inf"), None)
    return {
        "log_probs": error(verl["log_probs"], hook["log_probs"], relative=True),
        "entropy": error(verl["entropy"], hook["entropy"], relative=True),
        "loss": error(verl["loss"], hook["loss"], relative=True),
        "mtp_loss": error(verl["mtp"]["loss_values"], hook["mtp"]["loss_values"], relative=True),
        "acceptance_correct": (hook["mtp"]["correct_values"] - verl["mtp"]["correct_values"]).abs().max().item(),
        "acceptance_total": (hook["mtp"]["total_values"] - verl["mtp"]["total_values"]).abs().max().item(),
        "same_parameters": not differing_parameters(verl["grads"], hook["grads"]),
        "grads_rel": grads_rel,
        "worst_param": worst_param,
    }


def run_side(side: str, args, hf_config, report: dict, samples: dict) -> None:
    started = time.time()
    model = build_model(args, hf_config, announce=False, mtp_num_layers=args.mtp)
    report.setdefault("model", model_fields(model))
    engine = build_mtp_engine(model, hook=side == "hook", backend=args.mtp_backend, model_path=args.hf_config)
    print(
        f"[{side}] model built in {time.time() - started:.1f}s; fused kernels "
        f"{'on' if engine.engine_config.use_fused_kernels else 'off'}",
        flush=True,
    )
    clock = Clock(args.device)
    for entry in report["sizes"]:
        tokens = entry["tokens"]
        input_ids, data, advantages, old_offset, _ = e2e_rollout(hf_config.vocab_size, tokens, args.device, args.seed)
        batch = forward_step_batch(input_ids, data["prompts"], data["responses"], TEMPERATURE)
        row = {"side": side, "fused_kernels": engine.engine_config.use_fused_kernels}
        step = functools.partial(mtp_step, engine, model, batch, advantages, old_offset)
        try:
            free_step_memory(model)
            take_mtp_metrics()
            samples[(side, tokens)] = first_step_sample(model, batch, *step())
            for _ in range(args.warmups - 1):
                free_step_memory(model)
                step()
            row["train_s"], row["train_peak_bytes"], row["train_peak_abs_bytes"] = clock.measure(
                step, args.repeats, functools.partial(free_step_memory, model)
            )
            take_mtp_metrics()
            print(
                f"[{side}] {tokens} tokens: fwd+bwd {ms(row['train_s'])} peak {gib(row['train_peak_bytes'])}",
                flush=True,
            )
        except torch.OutOfMemoryError as oom:
            row["oom"] = str(oom).split("\n")[0]
            print(f"[{side}] {tokens} tokens: OOM ({row['oom']})", flush=True)
        if "oom" not in row:
            try:
                row["output_layer"] = output_layer_memory(step, model, batch)
                print(
                    f"[{side}] {tokens} tokens: output layer extra {gib_or_na(row['output_layer']['extra_bytes'])} "
                    f"(target {gib(row['output_layer']['target_bytes'])})",
                    flush=True,
                )
            except torch.OutOfMemoryError as oom:
                row["output_layer"] = {"oom": str(oom).split("\n")[0]}
        free_step_memory(model)
        take_mtp_metrics()
        entry["sides"].append(row)
        if side == "verl" and ("hook", tokens) in samples and ("verl", tokens) in samples:
            entry["hook_vs_verl"] = compare_sides(samples.pop(("verl", tokens)), samples.pop(("hook", tokens)))
    del engine, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gib_or_na(n: int | None) -> str:
    return "n/a" if n is None else gib(n)


def output_layer_table(report: dict) -> str:
    """The output layer's own extra memory per side and size (measured inside the step, see HeadMemoryProbe)."""
    lines = [
        f"The output layer's own memory in the MTP step {on_device(report)}:",
        "",
        "| tokens | side | output layer extra | extra less megatron's split buffer | hidden grad | weight grad "
        "| accumulator (4·H·rows) | target (1.5 GiB + accumulator) | within target (extra, less split) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in report["sizes"]:
        for row in entry["sides"]:
            head = row.get("output_layer")
            if head is None or "oom" in head:
                cells = ["OOM"] + ["-"] * 6
            else:
                within = ", ".join(
                    "n/a" if ok is None else ("yes" if ok else "NO")
                    for ok in (head["within_target"], head["within_target_without_split"])
                )
                cells = [
                    gib_or_na(head["extra_bytes"]),
                    gib_or_na(head["extra_without_split_bytes"]),
                    gib_or_na(head["hidden_grad_bytes"]),
                    gib_or_na(head["weight_grad_bytes"]),
                    gib(head["accumulator_bytes"]),
                    gib(head["target_bytes"]),
                    within,
                ]
            lines.append(f"| {entry['tokens']:,} | {row['side']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_table(report: dict) -> str:
    """The step table (time, peak, parity) and the output layer's table."""
    return step_table(report) + "\n\n" + output_layer_table(report)


def step_table(report: dict) -> str:
    lines = [
        f"MTP training step, hook against verl's, {on_device(report)}:",
        "",
        "| tokens | side | fused kernels | fwd+bwd time | fwd+bwd peak | log-prob rel | entropy rel | MTP loss rel "
        "| acceptance diff | grad rel (worst) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in report["sizes"]:
        parity = entry.get("hook_vs_verl")
        for row in entry["sides"]:
            timing = ["OOM", "OOM"] if "oom" in row else [ms(row["train_s"]), gib(row["train_peak_bytes"])]
            cells = ["reference" if row["side"] == "verl" else "-"] * 5
            if row["side"] == "hook" and parity is not None:
                cells = [
                    f"{parity['log_probs']:.2g}",
                    f"{parity['entropy']:.2g}",
                    f"{parity['mtp_loss']:.2g}",
                    f"{parity['acceptance_correct']:g}",
                    f"{parity['grads_rel']:.2g} ({parity['worst_param']})",
                ]
            lines.append(
                f"| {entry['tokens']:,} | {row['side']} | {row['fused_kernels']} | " + " | ".join(timing + cells) + " |"
            )
    return "\n".join(lines)


def run_mtp(args) -> dict:
    """The MTP benchmark for parsed e2e-bench arguments (args.mtp layers, args.vocab_size)."""
    hf_config = prepare_process(args, deterministic_parity=False)
    hf_config.vocab_size = args.vocab_size
    args.mtp_backend = "triton" if args.device == "cuda" else "torch"
    report = report_header(
        args, vocab_size=args.vocab_size, mtp_layers=args.mtp, dtype=str(args.dtype), hook_backend=args.mtp_backend
    )
    report["sizes"] = [{"tokens": tokens, "sides": []} for tokens in args.sizes]
    samples = {}
    for side in SIDES:
        run_side(side, args, hf_config, report, samples)
        write_report(report, args.out, "e2e_mtp", markdown_table)  # after each side: a cut-off run keeps its sides
    return report
