"""End to end with MTP (`e2e-bench --mtp`): one actor micro-batch with MTP training, verl as it ships vs hook mode.

One process, one device, TP=1. A GPTModel from a Hugging Face config (default:
Qwen2.5-7B shapes, 2 layers) with one MTP layer and the vocabulary overridden
(default 248320, a Qwen3.5-style vocabulary). Per side and micro-batch size,
through verl's build step with `mtp.enable=True, enable_train=True`,
`patch_engine_mtp` and `forward_step` (testing/mtp_engine.py), then a
GRPO-style loss over the response rows and its backward:

  verl   VERL_FUSED_USE_OP_HOOK unset: verl turns fused kernels off with MTP, so the
         main head and megatron's MTP loss build [tokens, vocab] logits
  hook   VERL_FUSED_USE_OP_HOOK=1: main head and MTP loss through the op (backend triton
         on CUDA, torch on the CPU)

Per row: median fwd+bwd time and peak memory above the weights and batch, or
OOM when the step ran out of device memory (recorded, not raised). Parity (hook
vs verl, where verl ran) on the first step: log-probs, entropy, loss, the logged
MTP loss, acceptance counts and every parameter gradient. Then one more step
with `HeadMemoryProbe` (testing/head_memory.py): the output layer's own extra
memory inside that real step (main head plus MTP heads, from the MTP loss call
to the hidden states' gradient), beside the op's fp32 hidden-gradient
accumulator and the issue's target (1.5 GiB plus that accumulator).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from .ab_parity import TEMPERATURE, grpo_loss
from .e2e_bench import Clock, _gib, _ms, free_step_memory, init_single_process, make_batch, write_report

SIDES = ("hook", "verl")  # hook first: verl's side may run out of memory


def _model(args, hf_config):
    from verl_fused_hook_harness.support.hf_model import build_gpt_from_hf

    return build_gpt_from_hf(
        hf_config, dtype=args.dtype, seed=args.seed, cpu_initialization=args.cpu_init, mtp_num_layers=args.mtp
    ).to(args.device)


def _step(engine, model, batch, advantages, old_offset):
    from verl_fused_hook_harness.support.mtp_engine import mtp_forward

    output = mtp_forward(engine, model, batch)
    loss = grpo_loss(output["log_probs"], output["entropy"], batch, advantages, old_offset)
    loss.backward()
    return output, loss


def _sample(model, batch, output, loss) -> dict:
    """The first step's results, on the CPU (so the other side's peak is not charged for them)."""
    from verl_fused_hook_harness.support.mtp_engine import take_mtp_metrics
    from verl_fused_hook.verl_integration.forward_step import response_score_rows

    rows = response_score_rows(batch, None).values()
    return {
        "log_probs": output["log_probs"].values()[rows].detach().float().cpu(),
        "entropy": output["entropy"].values()[rows].detach().float().cpu(),
        "loss": loss.detach().float().cpu(),
        "mtp": take_mtp_metrics(),
        "grads": {name: p.grad.detach().cpu() for name, p in model.named_parameters() if p.grad is not None},
    }


def output_layer_memory(step, model, batch) -> dict:
    """One more step under `HeadMemoryProbe`; scored rows: the main head's (the response rows, what hook mode
    scores) and each MTP layer's (its rolled loss mask, megatron's logged total)."""
    from verl_fused_hook_harness.support.head_memory import HeadMemoryProbe
    from verl_fused_hook_harness.support.mtp_engine import take_mtp_metrics
    from verl_fused_hook.verl_integration.forward_step import response_score_rows

    free_step_memory(model)
    take_mtp_metrics()
    with HeadMemoryProbe(model.shared_embedding_or_output_weight()) as probe:
        step()
    totals = take_mtp_metrics()["total_values"]
    scored = {"main": int(response_score_rows(batch, None).values().sum())}
    scored.update({f"mtp{k + 1}": int(totals[k]) for k in range(model.config.mtp_num_layers)})
    result = probe.result(scored)
    free_step_memory(model)
    return result


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.double().abs().max().clamp_min(1e-30)
    return ((got.double() - want.double()).abs().max() / scale).item()


def compare(verl: dict, hook: dict) -> dict:
    """Hook vs verl, relative to verl's largest magnitude; acceptance as absolute count differences."""
    grads = {name: _rel(hook["grads"][name], want) for name, want in verl["grads"].items() if name in hook["grads"]}
    worst = max(grads, key=grads.get) if grads else None
    return {
        "log_probs": _rel(hook["log_probs"], verl["log_probs"]),
        "entropy": _rel(hook["entropy"], verl["entropy"]),
        "loss": _rel(hook["loss"], verl["loss"]),
        "mtp_loss": _rel(hook["mtp"]["loss_values"], verl["mtp"]["loss_values"]),
        "acceptance_correct": (hook["mtp"]["correct_values"] - verl["mtp"]["correct_values"]).abs().max().item(),
        "acceptance_total": (hook["mtp"]["total_values"] - verl["mtp"]["total_values"]).abs().max().item(),
        "same_parameters": sorted(grads) == sorted(verl["grads"]) == sorted(hook["grads"]),
        "grads_rel": grads[worst] if worst else float("inf"),
        "worst_param": worst,
    }


def run_side(side: str, args, hf_config, report: dict, samples: dict) -> None:
    from verl_fused_hook_harness.support.mtp_engine import build_mtp_engine, mtp_batch, take_mtp_metrics

    started = time.time()
    model = _model(args, hf_config)
    engine = build_mtp_engine(model, hook=side == "hook", backend=args.mtp_backend, model_path=args.hf_config)
    print(f"[{side}] model built in {time.time() - started:.1f}s; fused kernels "
          f"{'on' if engine.engine_config.use_fused_kernels else 'off'}", flush=True)
    clock = Clock(args.device)
    for entry in report["sizes"]:
        tokens = entry["tokens"]
        input_ids, data, advantages, old_offset, _ = make_batch(hf_config.vocab_size, tokens, args.device, args.seed)
        batch = mtp_batch(input_ids, data["prompts"], data["responses"], TEMPERATURE)
        row = {"side": side, "fused_kernels": engine.engine_config.use_fused_kernels}
        step = functools.partial(_step, engine, model, batch, advantages, old_offset)
        try:
            free_step_memory(model)
            take_mtp_metrics()
            samples[(side, tokens)] = _sample(model, batch, *step())
            for _ in range(args.warmups - 1):
                free_step_memory(model)
                step()
            row["train_s"], row["train_peak_bytes"], row["train_peak_abs_bytes"] = clock.measure(
                step, args.repeats, functools.partial(free_step_memory, model)
            )
            take_mtp_metrics()
            print(f"[{side}] {tokens} tokens: fwd+bwd {_ms(row['train_s'])} peak {_gib(row['train_peak_bytes'])}", flush=True)
        except torch.OutOfMemoryError as error:
            row["oom"] = str(error).split("\n")[0]
            print(f"[{side}] {tokens} tokens: OOM ({row['oom']})", flush=True)
        if "oom" not in row:
            try:
                row["output_layer"] = output_layer_memory(step, model, batch)
                print(f"[{side}] {tokens} tokens: output layer extra {_bytes(row['output_layer']['extra_bytes'])} "
                      f"(target {_gib(row['output_layer']['target_bytes'])})", flush=True)
            except torch.OutOfMemoryError as error:
                row["output_layer"] = {"oom": str(error).split("\n")[0]}
        free_step_memory(model)
        take_mtp_metrics()
        entry["sides"].append(row)
        if side == "verl" and ("hook", tokens) in samples and ("verl", tokens) in samples:
            entry["hook_vs_verl"] = compare(samples.pop(("verl", tokens)), samples.pop(("hook", tokens)))
    del engine, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _bytes(n: int | None) -> str:
    return "n/a" if n is None else _gib(n)


def output_layer_table(report: dict) -> str:
    """The output layer's own extra memory per side and size (measured inside the step, see HeadMemoryProbe)."""
    lines = [
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
                within = ", ".join("n/a" if ok is None else ("yes" if ok else "NO")
                                   for ok in (head["within_target"], head["within_target_without_split"]))
                cells = [_bytes(head["extra_bytes"]), _bytes(head["extra_without_split_bytes"]),
                         _bytes(head["hidden_grad_bytes"]), _bytes(head["weight_grad_bytes"]),
                         _gib(head["accumulator_bytes"]), _gib(head["target_bytes"]), within]
            lines.append(f"| {entry['tokens']:,} | {row['side']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_table(report: dict) -> str:
    """The step table (time, peak, parity) and the output layer's table."""
    return step_table(report) + "\n\n" + output_layer_table(report)


def step_table(report: dict) -> str:
    lines = [
        "| tokens | side | fused kernels | fwd+bwd time | fwd+bwd peak | log-prob rel | entropy rel | MTP loss rel "
        "| acceptance diff | grad rel (worst) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for entry in report["sizes"]:
        parity = entry.get("hook_vs_verl")
        for row in entry["sides"]:
            timing = (["OOM", "OOM"] if "oom" in row else [_ms(row["train_s"]), _gib(row["train_peak_bytes"])])
            cells = ["reference" if row["side"] == "verl" else "-"] * 5
            if row["side"] == "hook" and parity is not None:
                cells = [f"{parity['log_probs']:.2g}", f"{parity['entropy']:.2g}", f"{parity['mtp_loss']:.2g}",
                         f"{parity['acceptance_correct']:g}", f"{parity['grads_rel']:.2g} ({parity['worst_param']})"]
            lines.append(f"| {entry['tokens']:,} | {row['side']} | {row['fused_kernels']} | " + " | ".join(timing + cells) + " |")
    return "\n".join(lines)


def run_mtp(args) -> dict:
    """The MTP benchmark for parsed e2e-bench arguments (args.mtp layers, args.vocab_size)."""
    from verl_fused_hook_harness.support.hf_model import load_hf_config
    from verl_fused_hook.verl_integration import install

    install()
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401  (fires the plugin's build gate)

    init_single_process(args.device, args.seed)
    hf_config = load_hf_config(args.hf_config)
    hf_config.vocab_size = args.vocab_size
    args.mtp_backend = "triton" if args.device == "cuda" else "torch"
    report = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "hf_config": str(args.hf_config),
        "vocab_size": args.vocab_size,
        "mtp_layers": args.mtp,
        "dtype": str(args.dtype),
        "hook_backend": args.mtp_backend,
        "warmups": args.warmups,
        "repeats": args.repeats,
        "sizes": [{"tokens": tokens, "sides": []} for tokens in args.sizes],
    }
    samples = {}
    for side in SIDES:
        run_side(side, args, hf_config, report, samples)
        write_mtp_outputs(report, args.out)  # after each side, so a cut-off run keeps what it measured
    return report


def write_mtp_outputs(report: dict, out: Path | None) -> None:
    write_report(report, out, "e2e_mtp", markdown_table)
