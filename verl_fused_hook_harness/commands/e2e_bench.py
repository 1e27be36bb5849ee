"""End to end: what VERL_FUSED_USE_OP_HOOK does to one training micro-batch's memory and time, through verl's engine.

One process, one device, TP=1. A GPTModel is built from a Hugging Face config
through mbridge's config conversion (default: the shipped Qwen2.5-7B-shaped
2-layer config, bf16, random weights from a fixed seed). For each THD-packed
micro-batch size (several sequences of mixed lengths, each half prompt, half
response) and each mode, the model goes through verl's real build step
(`MegatronEngine._maybe_enable_fused_kernels`, mode chosen by the environment
switch) and verl's real engine forward (`get_mcore_forward_fused_model_engine_fn`),
then a GRPO-style clipped policy loss over the response rows verl reads and
its backward. Modes:

  legacy        VERL_FUSED_USE_OP_HOOK=0: verl's monkey-patched forward and its kernel
  hook+verl     VERL_FUSED_USE_OP_HOOK=1, output_processor_backend=verl (same kernel)
  hook+ours     VERL_FUSED_USE_OP_HOOK=1, output_processor_backend=triton (this package's kernel)
  hook+ours+mask  as hook+ours, scoring only the response rows verl reads (score mask: prompt rows skipped)

On CUDA verl's kernel is verl's Triton kernel and ours is the `triton`
backend. On the CPU (to validate the flow; timings there mean nothing) neither
Triton kernel can run: the legacy forward's kernel is swapped for the portable
op and both kernels are the `torch` backend, as in the A/B script (tools/ab_parity.py).

Per size and mode: median time and peak memory of forward+backward and of the
no-grad forward (CUDA events / torch.cuda.max_memory_allocated; peak is above
what was allocated before the step, weights and batch: activations, the
parameter gradients and the kernel's buffers), after warm-ups. Parity
is measured on the first warm-up step against legacy: log-probs and entropy on
the rows the loss reads, the loss, and every parameter gradient. On CUDA that
step runs bitwise repeatable (`verl_fused_hook_harness.support.determinism`: SDPA's
attention backward and megatron's embedding backward otherwise accumulate with
atomic adds), and legacy runs it twice: the rerun must be identical, so
hook+verl's zero is a real zero. Timed steps run with PyTorch's defaults.

`--layout bshd` runs verl's padded layout instead (engines with `use_remove_padding=False`, the same
sequences right-padded to the longest): verl has no fused path there, so the reference is verl as it
ships (switch unset: its build step turns fused kernels off and `forward_step` runs the unfused BSHD
forward over full logits) against hook mode, which keeps fused kernels on (tools/e2e_bshd.py). Every
mode goes through verl's `forward_step`. A mode that runs out of device memory is reported as OOM.

Usage: verl-fused-hook e2e-bench [--hf-config PATH] [--sizes 16384,32768,65536] [--layout thd|bshd] [--out DIR]
       verl-fused-hook e2e-bench --mtp 1 [--vocab-size 248320] [--sizes 32768,65536,131072] [--out DIR]
       verl-fused-hook e2e-bench --fused-loss [--modes hook+ours+mask,hook+ours+fused-loss,legacy] [--out DIR]
(--mtp N: verl as it ships with MTP training vs hook mode's fused MTP loss, tools/e2e_bench_mtp.py;
 --fused-loss: the actor update through verl's forward_step with ppo_loss, output_processor_fused_loss off vs on,
 tools/e2e_fused_loss.py)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..support.determinism import deterministic_steps, prepare_cublas_workspace
from .ab_parity import ENV_VAR, TEMPERATURE, grpo_loss, max_abs

QWEN_7B_2LAYER = Path(__file__).resolve().parents[1] / "configs" / "qwen2_5_7b_2layer"
SEQUENCES_PER_BATCH = 8


@dataclass(frozen=True)
class Mode:
    name: str
    hook: bool
    kernel: str  # "verl" or "ours"
    masked: bool = False


MODES = (
    Mode("legacy", hook=False, kernel="verl"),
    Mode("hook+verl", hook=True, kernel="verl"),
    Mode("hook+ours", hook=True, kernel="ours"),
    Mode("hook+ours+mask", hook=True, kernel="ours", masked=True),
)
REFERENCE = {"thd": "legacy", "bshd": "verl-unfused"}
PARITY_KEY = {"thd": "vs_legacy", "bshd": "vs_verl_unfused"}


# ---------------------------------------------------------------- batch


def sequence_lengths(total: int, count: int, seed: int) -> list[int]:
    """`count` mixed lengths (ratio up to 4:1) summing to `total`, each even and >= 4."""
    generator = torch.Generator().manual_seed(seed + total)
    weights = 0.5 + 1.5 * torch.rand(count, generator=generator)
    lengths = [max(4, 2 * int(total * w / weights.sum() / 2)) for w in weights.tolist()]
    lengths[-1] += total - sum(lengths)
    if lengths[-1] < 4:
        raise ValueError(f"cannot split {total} tokens into {count} sequences of >= 4 tokens")
    return lengths


def make_batch(vocab_size: int, total: int, device: str, seed: int):
    """Nested input_ids/prompts/responses (verl's THD layout), GRPO advantages and old-log-prob offsets."""
    from verl.utils import tensordict_utils as tu

    generator = torch.Generator().manual_seed(seed + 7 * total)
    lengths = sequence_lengths(total, SEQUENCES_PER_BATCH, seed)
    prompts = [torch.randint(0, vocab_size, (n // 2,), generator=generator) for n in lengths]
    responses = [torch.randint(0, vocab_size, (n - n // 2,), generator=generator) for n in lengths]
    advantages = torch.randn(len(lengths), generator=generator)
    old_offset = 0.05 * torch.randn(len(lengths), max(r.numel() for r in responses), generator=generator)

    def nested(parts):
        return torch.nested.as_nested_tensor([p.to(device) for p in parts], layout=torch.jagged)

    input_ids = nested([torch.cat(pair) for pair in zip(prompts, responses)])
    data = tu.get_tensordict({"input_ids": input_ids, "prompts": nested(prompts), "responses": nested(responses)})
    return input_ids, data, advantages.to(device), old_offset.to(device), lengths


# ---------------------------------------------------------------- model and modes


def init_single_process(device: str, seed: int) -> None:
    import torch.distributed as dist

    from verl_fused_hook_harness.support.distributed import free_port
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel

    if device == "cuda" and not dist.is_initialized():
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    init_model_parallel(1, seed=seed)


def reset_fused_mode(model) -> None:
    """Undo a previous build step on this model (verl's unpatch, verl's mode record, the plugin's plan)."""
    from verl.models.mcore.model_forward_fused import unpatch_fused_forward

    from verl_fused_hook.verl_integration.model_plan import VERL_MODE_ATTRIBUTE, set_plan

    unpatch_fused_forward(model)
    model.__dict__.pop(VERL_MODE_ATTRIBUTE, None)
    set_plan(model, None)


def enable_mode(model, engine, mode: Mode) -> str:
    """verl's build step for `mode` on `model`, through the environment switch; returns the resolved mode."""
    from verl_fused_hook.verl_integration.model_plan import VERL_MODE_ATTRIBUTE

    reset_fused_mode(model)
    os.environ[ENV_VAR] = "1" if mode.hook else "0"
    engine._maybe_enable_fused_kernels()
    resolved = getattr(model, VERL_MODE_ATTRIBUTE, None)
    expected = "hook" if mode.hook else "legacy"
    if resolved != expected:
        raise RuntimeError(f"mode {mode.name}: verl's build step resolved {resolved!r}, expected {expected!r}")
    return resolved


# ---------------------------------------------------------------- one step


class Step:
    """Forward (+ loss and backward) of one micro-batch in one mode."""

    def __init__(self, model, engine, batch, mode: Mode, device: str, cpu_kernel: str):
        self.model, self.engine, self.mode, self.device = model, engine, mode, device
        self.input_ids, self.data, self.advantages, self.old_offset, _ = batch
        self.cpu_kernel = cpu_kernel
        self.score_rows = None
        if mode.masked:
            from verl_fused_hook.verl_integration.forward_step import response_score_rows

            self.score_rows = response_score_rows(self.data, None)  # the rows ppo_loss / forward-only steps read
            if self.score_rows is None:
                raise RuntimeError("score mask: the batch's prompt/response lengths do not describe input_ids")

    def _kernel_context(self):
        if self.device == "cpu" and not self.mode.hook:
            from verl_fused_hook_harness.stand_ins.legacy_kernel_swap import portable_legacy_kernel

            return portable_legacy_kernel(self.cpu_kernel)
        return contextlib.nullcontext()

    def forward(self):
        from verl_fused_hook_harness.support.verl_engine import fused_engine_forward

        kwargs = {} if self.score_rows is None else {"score_rows": self.score_rows}
        with self._kernel_context():
            return fused_engine_forward(self.engine, self.model, self.input_ids, TEMPERATURE, **kwargs)

    def train(self):
        """Forward, loss, backward; gradients are written into .grad (callers free them between steps)."""
        output = self.forward()
        loss = grpo_loss(output["log_probs"], output["entropy"], self.data, self.advantages, self.old_offset)
        with self._kernel_context():
            loss.backward()
        return output, loss

    def scored(self, values: torch.Tensor) -> torch.Tensor:
        """Values on the rows the loss reads (the only rows the masked mode computes), flattened."""
        from verl_fused_hook.verl_integration.forward_step import response_score_rows

        rows = response_score_rows(self.data, None).values()
        return values.values()[rows]


def parity_sample(step: Step, repeatable) -> dict:
    """One forward+backward inside `repeatable()` (deterministic on CUDA), as a snapshot."""
    with repeatable():
        output, loss = step.train()
    return snapshot(step, output, loss)


def snapshot(step: Step, output, loss) -> dict:
    return {
        "log_probs": step.scored(output["log_probs"]).detach().float(),
        "entropy": step.scored(output["entropy"]).detach().float(),
        "all_log_probs": output["log_probs"].values().detach().float(),
        "policy_loss": loss.detach().float().reshape(1),
        "grads": {name: p.grad.detach().clone() for name, p in step.model.named_parameters() if p.grad is not None},
    }


def compare(reference: dict, other: dict) -> dict:
    """max_abs of log-probs/entropy (rows the loss reads) and loss; worst gradient max_abs and relative error."""
    rows = {key: max_abs(reference[key], other[key]) for key in ("log_probs", "entropy", "policy_loss")}
    if reference["grads"].keys() != other["grads"].keys():
        raise RuntimeError(f"gradient sets differ: {sorted(reference['grads'].keys() ^ other['grads'].keys())}")
    worst_abs, worst_rel, worst_name = 0.0, 0.0, None
    for name, ref in reference["grads"].items():
        error = max_abs(ref, other["grads"][name])
        scale = ref.double().abs().max().item()
        relative = error / scale if scale > 0 else error
        worst_abs = max(worst_abs, error)
        if relative > worst_rel or worst_name is None:
            worst_rel, worst_name = relative, name
    rows.update(grads_max_abs=worst_abs, grads_rel=worst_rel, worst_param=worst_name)
    return rows


# ---------------------------------------------------------------- timing


class Clock:
    def __init__(self, device: str):
        self.device = device

    def sync(self):
        if self.device == "cuda":
            torch.cuda.synchronize()

    def measure(self, fn, repeats: int, prepare=None) -> tuple[float, int, int]:
        """Median seconds of fn() over `repeats`, the largest peak bytes above what was allocated before
        (after `prepare()`, untimed), and the largest absolute peak (CUDA; 0 on the CPU)."""
        times, peaks, absolute = [], [], [0]
        for _ in range(repeats):
            if prepare is not None:
                prepare()
            self.sync()
            if self.device == "cuda":
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
                peaks.append(torch.cuda.max_memory_allocated() - base)
                absolute.append(torch.cuda.max_memory_allocated())
            else:
                from verl_fused_hook_harness.support.memory import PeakMemory

                started = time.perf_counter()
                tracker = PeakMemory()
                with tracker:
                    fn()
                times.append(time.perf_counter() - started)
                peaks.append(tracker.peak)
        return statistics.median(times), max(peaks), max(absolute)


def free_step_memory(model) -> None:
    """Drop the last step's gradients and return cached blocks, so every step starts from weights and batch."""
    for param in model.parameters():
        param.grad = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- report


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def markdown_table(report: dict) -> str:
    lines = [
        "| tokens (sequences) | mode | kernel | fwd+bwd time | fwd+bwd peak | no-grad fwd time | no-grad fwd peak |"
        " log-prob max_abs | entropy max_abs | loss max_abs | grad max_abs (rel) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    parity_key = PARITY_KEY[report.get("layout", "thd")]
    for size in report["sizes"]:
        label = f"{size['tokens']:,} ({len(size['sequence_lengths'])})"
        if "padded_tokens" in size:
            label += f", padded {size['padded_tokens']:,}"
        for row in size["modes"]:
            if row.get("oom"):
                lines.append(f"| {label} | {row['mode']} | {row['kernel']} | OOM | OOM | | | | | | |")
                continue
            parity = row.get(parity_key)
            if parity is None:
                cells = ["reference"] * 3 + ["reference"]
            else:
                cells = [
                    f"{parity['log_probs']:.3g}",
                    f"{parity['entropy']:.3g}",
                    f"{parity['policy_loss']:.3g}",
                    f"{parity['grads_max_abs']:.3g} ({parity['grads_rel']:.2g})",
                ]
            lines.append(
                f"| {label} | {row['mode']} | {row['kernel']} | {_ms(row['train_s'])} | {_gib(row['train_peak_bytes'])} "
                f"| {_ms(row['forward_s'])} | {_gib(row['forward_peak_bytes'])} | " + " | ".join(cells) + " |"
            )
        floor = size.get("legacy_rerun")
        if floor is not None:
            lines.append(
                f"| {label} | legacy rerun | (repeatability) | | | | | {floor['log_probs']:.3g} | {floor['entropy']:.3g} "
                f"| {floor['policy_loss']:.3g} | {floor['grads_max_abs']:.3g} ({floor['grads_rel']:.2g}) |"
            )
    return "\n".join(lines)


def write_report(report: dict, out: Path | None, stem: str, table: Callable[[dict], str]) -> None:
    """out/STEM.json and out/STEM.md (the report through `table`); nothing without --out. Every e2e tool's."""
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table(report) + "\n")


def write_outputs(report: dict, out: Path | None) -> None:
    write_report(report, out, "e2e", markdown_table)


# ---------------------------------------------------------------- main


def run(args) -> dict:
    from verl_fused_hook_harness.support.hf_model import build_gpt_from_hf, load_hf_config
    from verl_fused_hook_harness.support.verl_engine import megatron_engine
    from verl_fused_hook.verl_integration import install

    device = args.device
    layout = args.layout
    kernels = {"verl": "verl", "ours": "triton"} if device == "cuda" else {"verl": "torch", "ours": "torch"}
    if layout == "bshd":
        from . import e2e_bshd

        kernels["unfused"] = "unfused"  # verl's full-logits forward, no fused kernel
    install()  # what `import verl` does through the entry point when the package is installed
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401  (fires the plugin's build gate)

    if device == "cuda":
        prepare_cublas_workspace()  # before the first GEMM: the parity steps run deterministic
    init_single_process(device, args.seed)
    hf_config = load_hf_config(args.hf_config)
    started = time.time()
    model = build_gpt_from_hf(hf_config, dtype=args.dtype, seed=args.seed, cpu_initialization=args.cpu_init).to(device)
    print(f"model built in {time.time() - started:.1f}s: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B "
          f"parameters, {args.dtype}, hidden {hf_config.hidden_size}, vocab {hf_config.vocab_size}", flush=True)
    all_modes = MODES if layout == "thd" else e2e_bshd.BSHD_MODES
    if layout == "thd":
        engines = {
            mode.name: megatron_engine(
                [model],
                fused_kernel_options={"output_processor_backend": kernels[mode.kernel]} if mode.hook else {},
                model_path=args.hf_config,
            )
            for mode in MODES
        }
        enable, step_class = enable_mode, Step
    else:
        engines = {
            mode.name: e2e_bshd.bshd_engine(model, mode, kernels[mode.kernel] if mode.hook else None, args.hf_config)
            for mode in all_modes
        }
        enable, step_class = e2e_bshd.enable_bshd_mode, e2e_bshd.BshdStep
    reference_name, parity_key = REFERENCE[layout], PARITY_KEY[layout]
    clock = Clock(device)
    report = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "hf_config": str(args.hf_config),
        "dtype": str(args.dtype),
        "temperature": TEMPERATURE,
        "warmups": args.warmups,
        "repeats": args.repeats,
        "kernels": kernels,
        "layout": layout,
        "sizes": [],
    }
    modes = [m for m in all_modes if m.name in args.modes]
    # Padded layout: the reference is different arithmetic (unfused), held to a tolerance, so no deterministic mode.
    deterministic = device == "cuda" and layout == "thd"
    repeatable = functools.partial(deterministic_steps, model) if deterministic else contextlib.nullcontext
    for tokens in args.sizes:
        batch = make_batch(hf_config.vocab_size, tokens, device, args.seed)
        entry = {"tokens": tokens, "sequence_lengths": batch[4], "modes": []}
        if layout == "bshd":
            entry["padded_tokens"] = e2e_bshd.padded_tokens(batch[4])
        report["sizes"].append(entry)
        reference = None
        for mode in modes:
            resolved = enable(model, engines[mode.name], mode)
            step = step_class(model, engines[mode.name], batch, mode, device, kernels["ours"])
            row = {"mode": mode.name, "resolved": resolved, "kernel": kernels[mode.kernel], "masked": mode.masked}
            try:
                measure_mode(step, row, entry, repeatable, clock, args, reference_name, parity_key, reference)
            except torch.OutOfMemoryError:
                row["oom"] = True
                print(f"[{tokens}] {mode.name:<15} out of device memory", flush=True)
            if mode.name == reference_name:
                reference = row.pop("_sample", None)
            row.pop("_sample", None)
            del step
            free_step_memory(model)
            entry["modes"].append(row)
            if row.get("oom"):
                continue
            parity = row.get(parity_key)
            note = (
                "" if parity is None else
                f"; vs {reference_name}: log_probs {parity['log_probs']:.3g}, entropy {parity['entropy']:.3g}, loss "
                f"{parity['policy_loss']:.3g}, grads {parity['grads_max_abs']:.3g} (rel {parity['grads_rel']:.2g})"
            )
            print(f"[{tokens}] {mode.name:<15} fwd+bwd {_ms(row['train_s'])} peak {_gib(row['train_peak_bytes'])}; "
                  f"no-grad fwd {_ms(row['forward_s'])} peak {_gib(row['forward_peak_bytes'])}{note}", flush=True)
        reference = None
        free_step_memory(model)
        write_outputs(report, args.out)  # after every size, so a cut-off run keeps what it measured
    reset_fused_mode(model)
    return report


def measure_mode(step, row, entry, repeatable, clock, args, reference_name, parity_key, reference) -> None:
    """Parity sample (first warm-up), warm-ups, timed training steps and no-grad forwards of one mode, into `row`.
    The reference mode leaves its sample in row["_sample"] for the modes after it."""
    model = step.model
    free_step_memory(model)
    sample = parity_sample(step, repeatable)  # first warm-up
    if step.mode.name == reference_name:
        row["_sample"] = sample
        if args.device == "cuda" and reference_name == "legacy":
            free_step_memory(model)
            entry["legacy_rerun"] = compare(sample, parity_sample(step, repeatable))
    elif reference is not None:
        row[parity_key] = compare(reference, sample)
        if not step.mode.masked:
            row[parity_key]["all_rows_log_probs"] = max_abs(reference["all_log_probs"], sample["all_log_probs"])
    free_step_memory(model)
    for _ in range(args.warmups - 1):
        free_step_memory(model)
        step.train()
    prepare = functools.partial(free_step_memory, model)
    row["train_s"], row["train_peak_bytes"], row["train_peak_abs_bytes"] = clock.measure(step.train, args.repeats, prepare)
    free_step_memory(model)

    def forward_no_grad():
        with torch.no_grad():
            step.forward()

    forward_no_grad()
    row["forward_s"], row["forward_peak_bytes"], row["forward_peak_abs_bytes"] = clock.measure(
        forward_no_grad, args.repeats
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hf-config", default=str(QWEN_7B_2LAYER), help="HF config.json or folder (default: Qwen2.5-7B shapes, 2 layers)"
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--sizes", default="16384,32768,65536", help="tokens per micro-batch, comma-separated, in run order")
    parser.add_argument("--modes", default=None, help="comma-separated subset of the layout's modes (default: all)")
    parser.add_argument("--layout", choices=("thd", "bshd"), default="thd",
                        help="thd: packed batches, legacy vs hook; bshd: padded (use_remove_padding=False), "
                        "verl as it ships (fused off, unfused forward) vs hook mode")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--warmups", type=int, default=2, help="forward+backward warm-ups per size and mode (>= 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--cpu-init", action=argparse.BooleanOptionalAction, default=None,
                        help="initialize weights on the CPU (default: on the CPU only when running there)")
    parser.add_argument("--out", type=Path, default=None, help="folder for e2e.json and e2e.md (rewritten after every size)")
    parser.add_argument("--mtp", type=int, default=0, metavar="N",
                        help="MTP benchmark instead: N MTP layers, verl as it ships vs hook mode (e2e_mtp.json/.md)")
    parser.add_argument("--vocab-size", type=int, default=248320, help="with --mtp: the vocabulary (default 248320)")
    parser.add_argument("--fused-loss", action="store_true",
                        help="fused-loss benchmark instead: verl's forward_step with ppo_loss, output_processor_fused_loss "
                        "off vs on (e2e_fused_loss.json/.md)")
    args = parser.parse_args(argv)

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if args.cpu_init is None:
        args.cpu_init = args.device == "cpu"
    args.dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    path = Path(args.hf_config)
    if not path.exists():
        parser.error(f"--hf-config: {path} does not exist; pass a config.json or a folder holding one")
    args.hf_config = str(path.parent if path.is_file() else path)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    if args.fused_loss and (args.mtp or args.layout == "bshd"):
        parser.error("--fused-loss runs on the packed layout without MTP; drop --mtp / --layout bshd")
    if args.fused_loss:
        from .e2e_fused_loss import LOSS_MODES as layout_modes, TWO_PASS
    elif args.layout == "bshd":
        from .e2e_bshd import BSHD_MODES

        layout_modes = BSHD_MODES
    else:
        layout_modes = MODES
    args.modes = set(args.modes.split(",")) if args.modes else {m.name for m in layout_modes}
    unknown = args.modes - {m.name for m in layout_modes}
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; allowed with "
                     f"{'--fused-loss' if args.fused_loss else f'--layout {args.layout}'}: "
                     f"{', '.join(m.name for m in layout_modes)}")
    reference = TWO_PASS if args.fused_loss else REFERENCE[args.layout]
    if reference not in args.modes:
        parser.error(f"--modes: {reference} is the reference every other mode is compared with; keep it")
    if args.mtp < 0 or args.vocab_size < 1:
        parser.error("--mtp must be >= 0 and --vocab-size >= 1")
    if args.mtp and args.layout == "bshd":
        parser.error("--mtp: the MTP benchmark runs on the packed layout; drop --layout bshd")
    if args.warmups < 1 or args.repeats < 1:
        parser.error("--warmups and --repeats must be >= 1")
    if args.mtp:
        from .e2e_bench_mtp import markdown_table as mtp_table, run_mtp

        logging.getLogger("verl_fused_hook").setLevel(logging.WARNING)
        print(mtp_table(run_mtp(args)))
        return 0
    logging.getLogger("verl_fused_hook").setLevel(logging.WARNING)
    if args.fused_loss:
        from .e2e_fused_loss import markdown_table as loss_table, run_fused_loss

        print(loss_table(run_fused_loss(args)))
        return 0

    report = run(args)
    print()
    print(markdown_table(report))
    write_outputs(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
