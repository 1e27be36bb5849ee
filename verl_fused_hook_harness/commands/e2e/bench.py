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
  hook+ours+mask+replay        with --replay TOP_K,TOP_P: as hook+ours+mask with output_processor_sampling_replay=true,
                               the engine built knowing the rollout's top_k / top_p: log-probs and entropy
                               renormalized over kept sets computed from the trainer's logits in the no-grad
                               forward (the old-log-prob pass); the training step replays those sets (pi_old's, as
                               the plugin carries them), never its own (the op replayed_log_probs)
  hook+ours+mask+replay-given  the same with the sets given in the batch (`rollout_kept_ids`, synthetic: each token's
                               label and 0 to top_k - 1 random other ids)

On CUDA verl's kernel is verl's Triton kernel and ours is the `triton`
backend. On the CPU (to validate the flow; timings there mean nothing) neither
Triton kernel can run: the legacy forward's kernel is swapped for the portable
op and both kernels are the `torch` backend, as in the A/B script (ab/parity.py).

Per size and mode: median time and peak memory of forward+backward and of the
no-grad forward (CUDA events / torch.cuda.max_memory_allocated; peak is above
what was allocated before the step, weights and batch: activations, the
parameter gradients and the kernel's buffers), after warm-ups, the timed repeats taken in
rounds over the modes (so a drift in the machine's speed does not favour one mode). Parity
is measured on the first warm-up step against legacy: log-probs and entropy on
the rows the loss reads, the loss, and every parameter gradient. On CUDA that
step runs bitwise repeatable (`verl_fused_hook_harness.support.determinism`: SDPA's
attention backward and megatron's embedding backward otherwise accumulate with
atomic adds), and legacy runs it twice: the rerun must be identical, so
hook+verl's zero is a real zero. Timed steps run with PyTorch's defaults. On
Transformer Engine's spec the attention keeps its own backward (no deterministic
fused THD backward at these sizes, support/determinism.py): there the rerun row
is that backward's noise floor. The replay modes have no parity with legacy (their values are renormalized over the
kept sets); their row holds the smallest rise of their log-probs over legacy's and the mean kept mass (thd.py).

`--layout bshd` runs verl's padded layout instead (engines with `use_remove_padding=False`, the same
sequences right-padded to the longest): verl has no fused path there, so the reference is verl as it
ships (switch unset: its build step turns fused kernels off and `forward_step` runs the unfused BSHD
forward over full logits) against hook mode, which keeps fused kernels on (e2e/bshd.py). Every
mode goes through verl's `forward_step`. A mode that runs out of device memory is reported as OOM.

`--moe` benchmarks an MoE-shaped model (Qwen3-30B-A3B shapes, 2 layers, configs/qwen3_30b_a3b_2layer; EP=1):
the output layer is the same kind of problem (hidden 2048, vocabulary 151936), next to 128 experts per layer
(megatron-core's MoE layer; without Transformer Engine its experts run one after another).

`--layer-spec te` builds the decoder on Transformer Engine's layer spec (mbridge's, as verl builds it: TE's attention
runs the packed batches), `local` on megatron-core's local spec with the harness's attention, `auto` (default) the
first where Transformer Engine imports on CUDA. `--layer-specs local,te` builds both models and times their steps in
the same rounds; `--output-layer-share` also times each step without the output layer (layer_specs.py), and the
second table gives each spec's times, the output layer's share of each step and te over local.
`--grad-accum-fusion` turns on megatron's gradient_accumulation_fusion (the model wrapped in megatron's DDP, whose
fp32 main_grad the weight gradients go into); `--batch-invariant` megatron's batch_invariant_mode. Both are refused at
start-up where they cannot run (support/layer_spec.py says what each needs).

Usage: verl-fused-hook e2e-bench [--hf-config PATH | --moe] [--sizes 16384,32768,65536] [--layout thd|bshd] [--out DIR]
                                 [--layers N] [--recompute] [--warmups W] [--repeats R] [--verbose]
                                 [--layer-spec auto|local|te | --layer-specs local,te] [--output-layer-share]
                                 [--grad-accum-fusion] [--batch-invariant] [--replay TOP_K,TOP_P]
       verl-fused-hook e2e-bench --mtp 1 [--vocab-size 248320] [--sizes 32768,65536,131072] [--out DIR]
       verl-fused-hook e2e-bench --fused-loss [--modes hook+ours+mask,hook+ours+fused-loss,legacy] [--out DIR]
       verl-fused-hook e2e-bench --distillation forward_kl_topk|k3|... [--topk 128] [--modes ...] [--out DIR]
(--mtp N: verl as it ships with MTP training vs hook mode's fused MTP loss, e2e/mtp.py;
 --fused-loss: the actor update through verl's forward_step with ppo_loss, output_processor_fused_loss off vs on,
 e2e/fused_loss.py;
 --distillation: the actor update with verl's distillation_ppo_loss, verl's unfused path vs hook mode,
 e2e/distillation.py)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import sys
from pathlib import Path

import torch

from verl_fused_hook.ops.kept_sets import DEFAULT_MAX_KEPT
from verl_fused_hook.verl_integration.sampling_replay import RolloutSampling, rollout_sampling

from ...support.arguments import DTYPES, add_device_argument, default_dtype, known_names, resolve_device
from ...support.compare import max_abs
from ...support.determinism import deterministic_steps
from ...support.hf_model import QWEN3_30B_A3B_2LAYER, QWEN_7B_2LAYER, config_folder
from ...support.layer_spec import batch_invariant_kernels
from ...support.micro_batches import e2e_rollout
from ...support.modes import kernel_backends
from ...support.reports import gib, ms, write_report
from ...support.upstream_notices import UpstreamNotices, add_verbose_argument
from ...support.verl_engine import megatron_engine, reset_fused_mode
from . import bshd, distillation, fused_loss, mtp
from .common import (
    Clock,
    Primed,
    build_model,
    free_step_memory,
    header_with_temperature,
    mark_out_of_memory,
    prepare_process,
    time_in_rounds,
)
from .layer_specs import (
    DECODER_ONLY,
    SPEC_KEY,
    DecoderOnlyStep,
    add_spec_arguments,
    output_layer_shares,
    resolve_specs,
    spec_table,
)
from .thd import (
    MODES,
    PARITY_KEY,
    REFERENCE,
    REPLAY_KEY,
    REPLAY_MODES,
    Step,
    compare_samples,
    enable_mode,
    fused_kernel_options,
    markdown_table,
    parity_note,
    parity_sample,
    replay_against_full,
)


def run(args) -> dict:
    """Every mode of `args.layout` per size (and layer spec): parity against the reference mode of the same model,
    times and peaks; the decoder alone too with `--output-layer-share`. Every timed step of a size, all specs'
    and modes' alike, goes in one set of rounds."""
    device, layout = args.device, args.layout
    kernels = kernel_backends(device)
    if layout == "bshd":
        kernels["unfused"] = "unfused"  # verl's full-logits forward, no fused kernel
    hf_config = prepare_process(args)
    models = {spec: build_model(args, hf_config, layer_spec=spec) for spec in args.layer_specs}
    if layout == "thd":
        all_modes, enable, step_class = MODES + (REPLAY_MODES if args.replay else ()), enable_mode, Step
        engines = {
            spec: {
                mode.name: megatron_engine(
                    [model],
                    fused_kernel_options=fused_kernel_options(mode, kernels) if mode.hook else {},
                    model_path=args.hf_config,
                )
                for mode in all_modes
            }
            for spec, model in models.items()
        }
    else:
        all_modes, enable, step_class = bshd.BSHD_MODES, bshd.enable_bshd_mode, bshd.BshdStep
        engines = {
            spec: {
                mode.name: bshd.bshd_engine(model, mode, kernels[mode.kernel] if mode.hook else None, args.hf_config)
                for mode in all_modes
            }
            for spec, model in models.items()
        }
    reference_name, parity_key = REFERENCE[layout], PARITY_KEY[layout]
    clock = Clock(device)
    several = len(models) > 1
    report = header_with_temperature(args, next(iter(models.values()))) | {
        "kernels": kernels,
        "layout": layout,
        **({"replay": {"top_k": args.replay.top_k, "top_p": args.replay.top_p}} if args.replay else {}),
        "sizes": [],
    }
    modes = [m for m in all_modes if m.name in args.modes]
    # Padded layout: the reference is different arithmetic (unfused), held to a tolerance, so no deterministic mode.
    deterministic = device == "cuda" and layout == "thd"

    def free_all():
        for model in models.values():
            free_step_memory(model)

    for tokens in args.sizes:
        batch = e2e_rollout(hf_config.vocab_size, tokens, device, args.seed)
        primed = []
        for spec, model in models.items():
            repeatable = functools.partial(deterministic_steps, model) if deterministic else contextlib.nullcontext
            entry = {"tokens": tokens, "sequence_lengths": batch[4], "modes": []}
            if several:
                entry[SPEC_KEY] = spec
            if layout == "bshd":
                entry["padded_tokens"] = bshd.padded_tokens(batch[4])
            report["sizes"].append(entry)
            tag = f"[{tokens}{f' {spec}' if several else ''}]"
            reference = None
            for mode in modes:
                mode_engine = engines[spec][mode.name]
                # the replay check is an inequality with a margin, not a bitwise comparison: PyTorch's defaults
                repeatable_step = contextlib.nullcontext if mode.replay else repeatable
                resolved = enable(model, mode_engine, mode)
                step = step_class(model, mode_engine, batch, mode, device, kernels["ours"])
                row = {
                    "mode": mode.name,
                    "resolved": resolved,
                    "kernel": kernels[mode.kernel],
                    "masked": mode.score_mask,
                }
                if several:
                    row[SPEC_KEY] = spec
                entry["modes"].append(row)
                try:
                    sample = prime_mode(step, row, entry, repeatable_step, args, reference_name, parity_key, reference)
                    if mode.name == reference_name:
                        reference = sample
                    del sample
                    parity = row.get(REPLAY_KEY, row.get(parity_key))
                    print(f"{tag} {mode.name:<15} warmed up{parity_note(reference_name, parity)}", flush=True)
                    primed.append(
                        Primed(
                            step,
                            row,
                            functools.partial(enable, model, mode_engine, mode),
                            {"train": step.train, "forward": functools.partial(forward_no_grad, step)},
                        )
                    )
                except torch.OutOfMemoryError:
                    mark_out_of_memory(model, tokens, row)
                del step
            reference = None
            if args.output_layer_share:
                primed += prime_decoder_only(model, engines[spec][modes[0].name], batch, entry, tag)
        time_in_rounds(
            primed,
            clock,
            args.repeats,
            {"train": free_all, "forward": None},
            lambda p: mark_out_of_memory(p.step.model, tokens, p.row),
        )
        free_all()
        for p in primed:
            row = p.row
            if not row.get("oom"):
                print(
                    f"[{tokens}{f' {row[SPEC_KEY]}' if several else ''}] {row['mode']:<15} fwd+bwd "
                    f"{ms(row['train_s'])} peak {gib(row['train_peak_bytes'])}; "
                    f"no-grad fwd {ms(row['forward_s'])} peak {gib(row['forward_peak_bytes'])}",
                    flush=True,
                )
        del primed
        for entry in report["sizes"][-len(models) :]:
            output_layer_shares(entry)
        free_all()
        write_report(report, args.out, "e2e", report_tables)  # after every size: a cut-off run keeps its sizes
    if args.profile is not None:
        (model,) = models.values()
        (spec_engines,) = engines.values()
        profile_steps(args, hf_config, model, spec_engines, modes, enable, step_class, kernels)
    for model in models.values():
        reset_fused_mode(model)
    return report


def prime_decoder_only(model, engine, batch, entry: dict, tag: str) -> list[Primed]:
    """The decoder alone (layer_specs.DecoderOnlyStep) warmed up and ready for the rounds; its row is the entry's
    `decoder_only`."""
    step = DecoderOnlyStep(model, batch, engine.model_config.tokenizer.pad_token_id)
    row = {"mode": DECODER_ONLY, **({SPEC_KEY: entry[SPEC_KEY]} if SPEC_KEY in entry else {})}
    entry["decoder_only"] = row
    try:
        step.switch()
        free_step_memory(model)
        step.train()
        free_step_memory(model)
        forward_no_grad(step)
    except torch.OutOfMemoryError:
        mark_out_of_memory(model, entry["tokens"], row)
        return []
    print(f"{tag} {DECODER_ONLY:<15} warmed up", flush=True)
    return [Primed(step, row, step.switch, {"train": step.train, "forward": functools.partial(forward_no_grad, step)})]


def prime_mode(step, row, entry, repeatable, args, reference_name, parity_key, reference) -> dict:
    """Parity sample (first warm-up), the other warm-ups and a no-grad warm-up of one mode, parity into `row`;
    returns the parity sample."""
    model = step.model
    free_step_memory(model)
    # first warm-up; the reference's gradients kept on the host: with two 7B models on an 80 GB card (two layer
    # specs in the same rounds) the reference and its rerun's gradients on the card ran legacy out of memory
    is_reference = step.mode.name == reference_name
    sample = parity_sample(step, repeatable, gradients_to_cpu=is_reference and args.device == "cuda")
    if is_reference:
        if args.device == "cuda" and reference_name == "legacy":
            free_step_memory(model)
            entry["legacy_rerun"] = compare_samples(sample, parity_sample(step, repeatable))
    elif reference is not None and step.mode.replay:
        row[REPLAY_KEY] = replay_against_full(reference, sample)
    elif reference is not None:
        row[parity_key] = compare_samples(reference, sample)
        if not step.mode.score_mask:
            row[parity_key]["all_rows_log_probs"] = max_abs(reference["all_log_probs"], sample["all_log_probs"])
    for _ in range(args.warmups - 1):
        free_step_memory(model)
        step.train()
    free_step_memory(model)
    forward_no_grad(step)
    return sample


def forward_no_grad(step) -> None:
    with torch.no_grad():
        step.forward()


def profile_steps(args, hf_config, model, engines, modes, enable, step_class, kernels) -> None:
    """One forward+backward and one no-grad forward per size and mode under torch's profiler, once every timing is
    done: after a profile with CUDA activity the host runs every operator slower for the rest of the process (on the
    H200 ~30% more host time per operator, the same calls), which a host-bound step shows in its time."""
    for tokens in args.sizes:
        batch = e2e_rollout(hf_config.vocab_size, tokens, args.device, args.seed)
        for mode in modes:
            enable(model, engines[mode.name], mode)
            step = step_class(model, engines[mode.name], batch, mode, args.device, kernels["ours"])

            for work, suffix in ((step.train, ""), (functools.partial(forward_no_grad, step), "_no_grad")):
                profile_work(work, mode.name, model, args.profile / f"profile_{tokens}_{mode.name}{suffix}.txt")
            del step
            free_step_memory(model)


def profile_work(work, mode_name: str, model, path: Path) -> None:
    """One call of `work` under torch's profiler: the operators by device time and by host time, written to `path`
    (why one mode's step takes longer than another's with the same kernel)."""
    from torch.profiler import ProfilerActivity, profile

    free_step_memory(model)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        work()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    averages = prof.key_averages()
    device_sort = "device_time_total" if torch.cuda.is_available() else "cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# {mode_name}: by device time\n{averages.table(sort_by=device_sort, row_limit=40)}\n"
        f"# {mode_name}: by host time\n{averages.table(sort_by='self_cpu_time_total', row_limit=40)}\n"
    )
    free_step_memory(model)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hf-config", default=None, help="HF config.json or folder (default: Qwen2.5-7B shapes, 2 layers)"
    )
    parser.add_argument(
        "--moe",
        action="store_true",
        help="an MoE model: the shipped Qwen3-30B-A3B-shaped config (hidden "
        "2048, 128 experts top-8, moe_ffn_hidden_size 768, vocab 151936), 2 layers, EP=1",
    )
    add_device_argument(parser)
    parser.add_argument(
        "--sizes", default="16384,32768,65536", help="tokens per micro-batch, comma-separated, in run order, each once"
    )
    parser.add_argument("--modes", default=None, help="comma-separated subset of the layout's modes (default: all)")
    parser.add_argument(
        "--layout",
        choices=("thd", "bshd"),
        default="thd",
        help="thd: packed batches, legacy vs hook; bshd: padded (use_remove_padding=False), "
        "verl as it ships (fused off, unfused forward) vs hook mode",
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--warmups", type=int, default=2, help="forward+backward warm-ups per size and mode (>= 1)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--cpu-init",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="initialize weights on the CPU (default: on the CPU only when running there)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for e2e.json and e2e.md (rewritten after every size)"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="then profile one forward+backward and one no-grad forward per size and mode (torch.profiler), "
        "after every timed step: DIR/profile_TOKENS_MODE.txt and DIR/profile_TOKENS_MODE_no_grad.txt",
    )
    parser.add_argument(
        "--mtp",
        type=int,
        default=0,
        metavar="N",
        help="MTP benchmark instead: N MTP layers, verl as it ships vs hook mode (e2e_mtp.json/.md)",
    )
    parser.add_argument("--vocab-size", type=int, default=248320, help="with --mtp: the vocabulary (default 248320)")
    parser.add_argument(
        "--policy-loss",
        choices=fused_loss.POLICY_LOSSES,
        default="vanilla",
        help="with --fused-loss: verl's ppo_loss with the vanilla clipped loss or GSPO, or sft_loss (an SFT step)",
    )
    parser.add_argument(
        "--fused-loss",
        action="store_true",
        help="fused-loss benchmark instead: verl's forward_step with ppo_loss, output_processor_fused_loss "
        "off vs on (fused_loss.json/.md)",
    )
    parser.add_argument(
        "--distillation",
        choices=distillation.LOSS_MODES,
        default=None,
        metavar="LOSS_MODE",
        help="distillation benchmark instead: an actor update with verl's distillation_ppo_loss of this "
        f"loss_mode ({', '.join(distillation.LOSS_MODES)}), verl's unfused path vs hook mode "
        "(e2e_distillation.json/.md)",
    )
    parser.add_argument("--topk", type=int, default=128, help="with --distillation forward_kl_topk: the teacher's k")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        metavar="N",
        help="the model's layer count instead of the HF config's (e.g. 28: the Qwen2.5-7B-shaped config at full depth)",
    )
    parser.add_argument(
        "--recompute",
        action="store_true",
        help="megatron's full activation recompute (recompute_granularity=full, recompute_method="
        "uniform, recompute_num_layers=1), as long-context training runs use it",
    )
    parser.add_argument(
        "--replay",
        default=None,
        metavar="TOP_K,TOP_P",
        help="also time sampling replay (output_processor_sampling_replay=true) with the rollout's top_k (1 to "
        f"{DEFAULT_MAX_KEPT}) and top_p (in (0, 1]): modes {', '.join(m.name for m in REPLAY_MODES)}",
    )
    add_spec_arguments(parser)
    add_verbose_argument(parser)
    args = parser.parse_args(argv)
    with UpstreamNotices(verbose=args.verbose):
        return run_command(parser, args)


def run_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The checked arguments' benchmark: the layout's modes, `--mtp` or `--fused-loss`."""
    args.device = resolve_device(parser, args.device)
    if args.cpu_init is None:
        args.cpu_init = args.device == "cpu"
    args.dtype = DTYPES[args.dtype or default_dtype(args.device)]
    if args.moe and args.hf_config is not None:
        parser.error(
            "--moe: the MoE model is the shipped Qwen3-30B-A3B-shaped config; drop --hf-config (or give "
            "an MoE config with --hf-config alone)"
        )
    try:
        args.hf_config = config_folder(args.hf_config or (QWEN3_30B_A3B_2LAYER if args.moe else QWEN_7B_2LAYER))
    except ValueError as error:
        parser.error(f"--hf-config: {error}")
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    repeated = sorted({size for size in args.sizes if args.sizes.count(size) > 1})
    if repeated:  # each would be measured again and reported as more rows (and reruns) at that size
        parser.error(f"--sizes: {repeated} given more than once; each size is measured and reported once")
    if args.policy_loss != "vanilla" and not args.fused_loss:
        parser.error("--policy-loss: only with --fused-loss")
    if args.fused_loss and (args.mtp or args.layout == "bshd"):
        parser.error("--fused-loss runs on the packed layout without MTP; drop --mtp / --layout bshd")
    if args.distillation and (args.mtp or args.fused_loss or args.layout == "bshd"):
        parser.error("--distillation runs on the packed layout alone; drop --mtp / --fused-loss / --layout bshd")
    if args.topk < 1:
        parser.error(f"--topk: expected >= 1, got {args.topk}")
    if args.replay is not None:
        if args.mtp or args.fused_loss or args.distillation or args.layout == "bshd":
            parser.error("--replay runs on the packed layout's modes; drop --mtp / --fused-loss / --distillation / "
                         "--layout bshd")  # fmt: skip
        args.replay = replay_sampling(parser, args.replay)
    if args.distillation:
        layout_modes = distillation.DISTILLATION_MODES
    elif args.fused_loss:
        layout_modes = fused_loss.LOSS_MODES
    elif args.layout == "bshd":
        layout_modes = bshd.BSHD_MODES
    else:
        layout_modes = MODES + (REPLAY_MODES if args.replay else ())
    flavour = "--distillation" if args.distillation else "--fused-loss" if args.fused_loss else None
    where = f" with {flavour or f'--layout {args.layout}'}"
    names = [m.name for m in layout_modes]
    if args.modes and not args.replay:
        asked = {name for name in args.modes.split(",") if name} & {m.name for m in REPLAY_MODES}
        if asked:
            parser.error(f"--modes: {sorted(asked)} need --replay TOP_K,TOP_P (the rollout's truncation)")
    args.modes = set(known_names(parser, "--modes", args.modes, names, where) if args.modes else names)
    if args.distillation:
        reference = distillation.REFERENCE
    else:
        reference = fused_loss.TWO_PASS if args.fused_loss else REFERENCE[args.layout]
    if reference not in args.modes:
        parser.error(f"--modes: {reference} is the reference every other mode is compared with; keep it")
    if args.mtp < 0 or args.vocab_size < 1:
        parser.error("--mtp must be >= 0 and --vocab-size >= 1")
    if args.mtp and args.layout == "bshd":
        parser.error("--mtp: the MTP benchmark runs on the packed layout; drop --layout bshd")
    if args.warmups < 1 or args.repeats < 1:
        parser.error("--warmups and --repeats must be >= 1")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers: expected >= 1, got {args.layers}")
    resolve_specs(parser, args)
    logging.getLogger("verl_fused_hook").setLevel(logging.WARNING)
    with batch_invariant_kernels(args.batch_invariant):
        return run_benchmark(args)


def replay_sampling(parser: argparse.ArgumentParser, text: str) -> RolloutSampling:
    """`--replay TOP_K,TOP_P` as the rollout's sampling. top_k must truncate: without it a top-p set of a random
    model's near-flat logits spans most of the vocabulary, past any max_kept."""
    try:
        top_k_text, top_p_text = text.split(",")
        top_k, top_p = int(top_k_text), float(top_p_text)
    except ValueError:
        parser.error(f"--replay: expected TOP_K,TOP_P (e.g. 50,0.9), got {text!r}")
    if not 1 <= top_k <= DEFAULT_MAX_KEPT or not 0.0 < top_p <= 1.0:
        parser.error(
            f"--replay: expected 1 <= TOP_K <= {DEFAULT_MAX_KEPT} (output_processor_sampling_replay_max_kept's "
            f"default) and 0 < TOP_P <= 1, got {text!r}"
        )
    return RolloutSampling(top_k=top_k, top_p=top_p)


def run_benchmark(args: argparse.Namespace) -> int:
    """The benchmark the checked arguments ask for."""
    if args.mtp:
        print(mtp.markdown_table(mtp.run_mtp(args)))
    elif args.distillation:
        print(distillation.markdown_table(distillation.run_distillation(args)))
    elif args.fused_loss:
        print(fused_loss.markdown_table(fused_loss.run_fused_loss(args)))
    else:
        # the replay modes' engines are built knowing the rollout's truncation, as in verl's init_model
        with rollout_sampling(args.replay) if args.replay else contextlib.nullcontext():
            report = run(args)
        print()
        print(report_tables(report))
        write_report(report, args.out, "e2e", report_tables)
    return 0


def report_tables(report: dict) -> str:
    """The modes' table, and the layer specs' one where specs were compared or the decoder was timed alone."""
    tables = [markdown_table(report)]
    if len(report["layer_specs"]) > 1 or any("decoder_only" in entry for entry in report["sizes"]):
        tables.append(spec_table(report))
    return "\n\n".join(tables)


if __name__ == "__main__":
    sys.exit(main())
