"""A/B parity: verl's legacy fused forward (VERL_FUSED_USE_OP_HOOK=0) against the output_processor hook (=1).

Each mode runs in its own processes (gloo on the CPU, NCCL on GPUs) on identical
weights (built from a Hugging Face config through mbridge's conversion, seeded)
and an identical THD batch. Both go through verl's real build step
(`MegatronEngine._maybe_enable_fused_kernels`) and verl's real engine forward
(`get_mcore_forward_fused_model_engine_fn`: nested inputs, rolled labels),
then a GRPO-style clipped policy loss over the response rows verl reads
(`no_padding_2_padding`) and its backward. Compared: log-probs and entropy on
every row, the loss, and every parameter gradient on every rank; max_abs must
be exactly 0 when both modes use one kernel (the default): verl's Triton kernel
on CUDA, the portable op on the CPU (the legacy forward's kernel is swapped for it).

One gap is expected and reported, not failed: with TP>1 and sequence
parallelism off, verl's legacy forward never sums the hidden-state gradient
over the TP group, and the hook does. There the script also runs the legacy
forward with that all-reduce added ("legacy+tp-sum"), which must match the hook
exactly, proving the sum is the only difference. Which side is right is shown
against ground truth: every scenario also runs verl's unfused engine forward
(full logits, vocab-parallel log-softmax); the hook must agree with it within
a relative 1e-4 everywhere, the legacy gradients visibly do not there.

On CUDA (one process per GPU; with one GPU only the TP=1 scenarios run) every run is made
bitwise repeatable (`verl_fused_hook_harness.support.determinism`: deterministic attention backward and embedding
backward); legacy runs each scenario twice and that rerun must match exactly, so a zero below means
something. There the fused side takes fp32 inputs at TF32 in Triton's dot, so the unfused tolerance is 2e-3
(5e-2 for bf16 models, whose unfused logits are rounded to bf16).

`--backend triton` (CUDA, bf16) puts this package's kernel on the hook side while legacy keeps verl's: two
kernels, so hook vs legacy is held to the kernels' accuracy instead of 0 (log-probs, entropy and loss within
1e-4, every gradient within 2e-2 of its largest magnitude).

`--layer-spec te` builds the decoder on Transformer Engine's layer spec (mbridge's, as verl builds it; TE's attention
runs the packed batches), `local` on megatron-core's local spec with the harness's attention, `auto` (default) the
first where Transformer Engine imports on CUDA; `te` where it cannot build is refused at start-up.
`--batch-invariant` runs every scenario under megatron's batch_invariant_mode (TE with FlashAttention 3 or 4 only).

`--layout bshd` compares on verl's padded layout (`use_remove_padding=False`), where verl has no fused
path: hook mode against verl as it ships there (fused kernels off, its unfused BSHD forward), within the
unfused tolerance (ab/bshd.py).

Usage: verl-fused-hook ab-parity [--device cpu|cuda] [--tp 1|2|4] [--hf-config PATH] [--backend NAME]
                                  [--dtype fp32|bf16] [--layout thd|bshd] [--json PATH|-] [--mtp-layers N] [--verbose]
                                  [--pp N] [--vpp N] [--ep N] [--moe-experts N]
                                  [--layer-spec auto|local|te] [--batch-invariant]

Upstream warnings and log lines (megatron-core, verl, torch) are counted, not printed, and summarised in one
line at the end; `--verbose` prints them, and a line per scenario and mode.

`--pp N`, `--vpp N`, `--ep N`, `--moe-experts N` (any of them) run the pipeline/expert comparison instead
(ab/parallel.py): verl's train_batch through megatron's schedule, legacy vs hook vs verl's unfused path vs the
same model without the split, in fp32; with `--tp` as well. On the CPU TP x PP x EP gloo processes.

`--mtp-layers N` runs the MTP scenario instead (ab/mtp.py, packed layout): models with N MTP
layers, hook mode's fused MTP loss against verl's own MTP path (fused kernels off), within the unfused tolerance.
Exit status: 0 when hook and legacy match (exactly with one kernel on both sides, within the kernels'
accuracy with two) and the hook matches the unfused forward, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from verl_fused_hook.ops import BACKEND_CHOICES
from verl_fused_hook.switch import ENV_VAR

from ...support.arguments import DTYPES, add_device_argument, known_names, resolve_device
from ...support.distributed import backend_for, run_in_processes
from ...support.hf_model import TINY_QWEN2, config_folder
from ...support.layer_spec import (
    TE,
    add_layer_spec_arguments,
    batch_invariant_kernels,
    check_batch_invariant,
    check_padded_fp32,
    resolve_layer_spec,
)
from ...support.reports import write_json
from ...support.upstream_notices import UpstreamNotices, add_verbose_argument
from ...support.verl_engine import prepare_verl_process
from . import bshd, parallel, thd
from .mtp import run_mtp_parity
from .scenarios import (
    ENV_VALUES,
    SCENARIOS,
    TP4_SCENARIOS,
    UNFUSED_RTOL,
    UNFUSED_RTOL_BF16,
    UNFUSED_RTOL_CUDA,
    Scenario,
    Setup,
    world_size_for,
)

__all__ = ["Scenario", "UNFUSED_RTOL", "main"]  # what tests and callers reach through this module


def mode_worker(rank: int, world_size: int, mode: str, scenarios, setup: Setup):
    """Every scenario in this process's mode (set by the environment); one result dict per run."""
    prepare_verl_process(rank)
    if setup.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    results = {}
    for scenario in scenarios:
        started = time.time()
        with batch_invariant_kernels(setup.batch_invariant):
            if setup.layout == "bshd":
                results[scenario.name] = bshd.run_bshd(scenario, mode, setup)
            else:
                results.update(thd.run_scenario(scenario, mode, setup))
        if rank == 0 and setup.verbose:
            layout = " bshd" if setup.layout == "bshd" else ""
            print(f"[{mode}] {scenario.name}{layout} done in {time.time() - started:.1f}s", flush=True)
    return results


def run_mode(mode: str, scenarios, setup: Setup):
    """Every scenario in `mode`, in the processes of one run (gloo on the CPU, NCCL on GPUs); results by rank."""
    world_size = world_size_for(setup.device, scenarios)
    started = time.time()
    runs = run_in_processes(
        mode_worker,
        world_size,
        mode,
        scenarios,
        setup,
        backend=backend_for(setup.device),
        env={ENV_VAR: ENV_VALUES[mode]},
    )
    print(
        f"[{mode}] {len(scenarios)} scenario(s) done in {time.time() - started:.1f}s (process start-up included)",
        flush=True,
    )
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-config", default=None, help="HF config.json or folder (default: the shipped tiny Qwen2)")
    parser.add_argument(
        "--backend",
        default=None,
        help="the hook's op backend (default: verl on CUDA, torch on CPU: legacy's own kernel)",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=None,
        help="model dtype (default: bf16 with --backend triton, else fp32)",
    )
    add_device_argument(parser)
    parser.add_argument(
        "--tp",
        type=int,
        choices=(1, 2, 4),
        default=None,
        help="only the scenarios of this TP size (4: also pass a model whose KV heads divide by 4, e.g. "
        "verl_fused_hook_harness/configs/tiny_qwen2_kv4)",
    )
    parser.add_argument("--scenarios", default=None, help="comma-separated names, e.g. tp1/nosp/untied (default: all)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--layout",
        choices=("thd", "bshd"),
        default="thd",
        help="thd (default): legacy vs hook on packed batches; bshd: verl's padded layout (use_remove_padding=False), "
        "hook vs verl as it ships there (fused kernels off: its unfused forward)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON (- for stdout)")
    parser.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline-parallel size: verl's train_batch through "
        "megatron's schedule, legacy vs hook vs verl's unfused path vs the unsplit model (ab/parallel.py)",
    )
    parser.add_argument("--vpp", type=int, default=None, help="model chunks per pipeline stage (interleaved schedule)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size (data-parallel ranks = EP)")
    parser.add_argument(
        "--moe-experts",
        type=int,
        default=0,
        metavar="N",
        help="an MoE model with N experts, top-2 (default config: the shipped tiny Qwen3-MoE)",
    )
    parser.add_argument(
        "--mtp-layers",
        type=int,
        default=0,
        metavar="N",
        help="MTP scenario: models with N MTP layers, hook mode's fused MTP loss vs verl's MTP path "
        "(ab/mtp.py); 0 (default): the legacy/hook comparison",
    )
    add_layer_spec_arguments(parser)
    add_verbose_argument(parser)
    args = parser.parse_args(argv)
    with UpstreamNotices(verbose=args.verbose):
        return run(parser, args)


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """The checked arguments' runs: the legacy/hook comparison, or the MTP scenario."""
    if args.mtp_layers < 0:
        parser.error(f"--mtp-layers: expected an int >= 0, got {args.mtp_layers}")
    if args.mtp_layers and args.layout == "bshd":
        parser.error("--mtp-layers: the MTP scenario runs on the packed layout; drop --layout bshd")

    device = resolve_device(parser, args.device)
    backend = args.backend or ("verl" if device == "cuda" else "torch")
    if backend not in BACKEND_CHOICES:
        parser.error(f"--backend {backend!r}: allowed {', '.join(BACKEND_CHOICES)}")
    dtype = args.dtype or ("bf16" if backend == "triton" else "fp32")
    if backend == "triton" and dtype != "bf16":
        parser.error("--backend triton takes bf16 hidden states and weights: use --dtype bf16")
    if device == "cpu" and backend in ("verl", "triton"):
        parser.error(f"--backend {backend} needs CUDA (a Triton kernel); on the CPU use torch")
    try:
        hf_path = config_folder(args.hf_config or TINY_QWEN2)
    except ValueError as error:
        parser.error(f"--hf-config: {error}")
    known = SCENARIOS + TP4_SCENARIOS
    scenarios = TP4_SCENARIOS if args.tp == 4 else SCENARIOS
    if args.scenarios:
        wanted = known_names(parser, "--scenarios", args.scenarios, [s.name for s in known])
        scenarios = tuple(s for s in known if s.name in wanted)
    if args.tp is not None:
        scenarios = tuple(s for s in scenarios if s.tp == args.tp)
    if not scenarios:
        parser.error("--scenarios/--tp: no scenario left to run")
    world_size = world_size_for(device, scenarios)
    too_big = [s.name for s in scenarios if s.tp > world_size]
    if too_big and (args.scenarios or args.tp):
        parser.error(
            f"{', '.join(too_big)}: need {max(s.tp for s in scenarios)} processes, {device} gives {world_size}"
        )
    if too_big:
        print(f"skipped ({world_size} GPU(s) here, too few for): {', '.join(too_big)}", flush=True)
        scenarios = tuple(s for s in scenarios if s.tp <= world_size)
    if parallel.parallel_flags_given(args):
        if args.layer_spec == TE or args.batch_invariant:
            parser.error(
                "--layer-spec te / --batch-invariant: the --pp/--vpp/--ep/--moe-experts comparison draws each layer's "
                "weights by its global index inside the local-spec build; use --layer-spec local (or auto)"
            )
        return run_parallel(parser, args, device, backend, hf_path if args.hf_config else None)
    choice = resolve_layer_spec(parser, args.layer_spec, device)
    check_batch_invariant(parser, args.batch_invariant, choice.spec)
    check_padded_fp32(parser, spec=choice.spec, layout=args.layout, fp32=dtype == "fp32")
    rtol = UNFUSED_RTOL_BF16 if dtype == "bf16" else UNFUSED_RTOL_CUDA if device == "cuda" else UNFUSED_RTOL
    setup = Setup(
        hf_path=hf_path,
        backend=backend,
        device=device,
        dtype=dtype,
        seed=args.seed,
        layout=args.layout,
        verbose=args.verbose,
        layer_spec=choice.spec,
        batch_invariant=args.batch_invariant,
    )
    print(f"layer spec: {choice.spec} ({choice.reason})", flush=True)
    if args.mtp_layers:
        return run_mtp_parity(scenarios, setup, args.mtp_layers, rtol, args.json)
    return run_parity(scenarios, setup, world_size, rtol, args.json)


def run_parallel(parser, args, device: str, backend: str, hf_path: str | None) -> int:
    """The --pp/--vpp/--ep/--moe-experts comparison (fp32, one process or GPU a rank)."""
    parallel.check_parallel_args(parser, args, hf_path)
    if args.dtype not in (None, "fp32"):
        parser.error("--pp/--vpp/--ep/--moe-experts run in fp32")
    case = parallel.parallel_case(args, hf_path, backend)
    if device == "cuda" and case.world > torch.cuda.device_count():
        parser.error(f"{case.name}: needs {case.world} GPUs, {torch.cuda.device_count()} here")
    return parallel.run_parallel_parity(case, device, device == "cpu" or backend == "verl", args.json)


def run_parity(scenarios, setup: Setup, world_size: int, rtol: float, json_path: str | None) -> int:
    """Both modes' runs of every scenario, the report (printed, and as JSON where asked); exit status."""
    device, backend, hf_path, dtype = setup.device, setup.backend, setup.hf_path, setup.dtype
    kernel_note = (
        f"both modes use the portable op (backend={backend}); verl's Triton kernel needs CUDA, so the legacy "
        "forward's kernel was swapped for it"
        if device == "cpu"
        else f"legacy uses verl's Triton kernel; hook uses backend={backend}"
    )
    if setup.layout == "bshd":
        kernel_note = (
            f"padded (BSHD) layout: verl as it ships (fused kernels off, unfused forward) vs hook backend={backend}"
        )
    print(
        f"A/B parity on {device} ({world_size} processes per mode), model {hf_path} in {dtype}; {kernel_note}",
        flush=True,
    )
    runs = {mode: run_mode(mode, scenarios, setup) for mode in ENV_VALUES}

    report = {
        "device": device,
        "backend": backend,
        "dtype": dtype,
        "one_kernel": setup.one_kernel,
        "hf_config": hf_path,
        "kernel_note": kernel_note,
        "unfused_rtol": rtol,
        "layout": setup.layout,
        "layer_spec": setup.layer_spec,
        "batch_invariant": setup.batch_invariant,
    }
    if setup.layout == "bshd":
        report["scenarios"] = [bshd.evaluate_bshd(scenario, runs, rtol) for scenario in scenarios]
        report["match"] = all(entry["match"] for entry in report["scenarios"])
        bshd.print_bshd_report(report)
    else:
        report["scenarios"] = [thd.evaluate(scenario, runs, setup.one_kernel, rtol) for scenario in scenarios]
        report["match"] = all(entry["match"] for entry in report["scenarios"])
        thd.print_report(report)
    if json_path:
        write_json(report, json_path)
    return 0 if report["match"] else 1


if __name__ == "__main__":
    sys.exit(main())
