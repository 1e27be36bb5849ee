"""Train parity: K GRPO steps through verl's Megatron engine in each fused-forward mode, with a checkpoint and a resume.

Every mode trains the same randomly initialised model (a Hugging Face config,
seeded weights) on the same synthetic GRPO batches through verl's real
`MegatronEngineWithLMHead`:

- per step, as `RayPPOTrainer.fit` does: a rollout in the trainer's padded
  layout (prompts of varying length, n=5 responses each of varying length,
  random outcome rewards) with GRPO advantages from verl's
  `compute_grpo_outcome_advantage`, turned into the packed layout by verl's
  `left_right_2_no_padding`; old log-probs (with entropy) from the actor engine
  and reference log-probs from a forward-only reference engine, both through
  `infer_batch` (forward only) and read back with `no_padding_2_padding`; then
  the actor update through `train_batch` (zero grad, `forward_backward_batch`
  over several micro-batches with verl's `ppo_loss` (clipped policy loss,
  entropy bonus, low-var KL to the reference), `optimizer_step`: Megatron DDP and
  distributed optimizer) and `lr_scheduler_step`, inside verl's
  `train_mode()`/`eval_mode()` contexts, which offload and reload;
- a checkpoint after step K/2 with verl's `save_checkpoint` (its
  `MegatronCheckpointManager`, Megatron distributed checkpointing of model,
  optimizer and RNG state), and a fresh process group that builds new engines,
  `load_checkpoint`s it and runs steps K/2+1..K;
- the whole run again with verl's parameter, gradient and optimizer offload on.

Modes (train/modes.py): legacy (VERL_FUSED_USE_OP_HOOK=0, verl's
monkey-patched forward), hook-verl (hook, backend verl: verl's Triton kernel;
CUDA only), hook-auto (hook, backend auto: this package's kernel, score mask
off), hook-auto-mask (hook, backend auto, score mask on: only the rows
`ppo_loss` reads are computed, the plugin's default for ppo_loss steps) and
hook-auto-fused-loss (hook-auto with `output_processor_fused_loss=True`: the
actor update's `ppo_loss` runs inside the op, its gradient formed in the
forward). Per step: the loss (sum over micro-batches, as verl's worker reports
it), the gradient norm (from the optimizer step), a checksum of every
parameter's bits on every rank (and the float64 sum), step time and peak
memory; per run: its wall time, engine build and checkpoint save/load time.

What verl runs and what is replaced: `MegatronEngine.__init__` and
`initialize()` run as shipped (mbridge's config conversion, verl's `get_model`
with DDP, the fused-kernel build step through the plugin's gate, verl's
`get_megatron_optimizer`, LR scheduler, `MegatronCheckpointManager`, offload)
except `_build_megatron_module`, which would load a checkpoint (a random model
has none). `--layer-spec te` (auto on CUDA where Transformer Engine imports)
runs verl's own build up to that load: `make_megatron_module`, mbridge's
`get_model` with TE's layer spec, seeded weights (support/train_engine.py); with
`--bridge megatron-bridge` Megatron-Bridge's provider instead (verl 0.9.1's default builder).
`--layer-spec local` runs the stand-in (`stand_ins/local_spec_build.py`): verl's own
`get_model` with a provider that builds the GPTModel with megatron-core's local spec
and seeded random weights (verl's bridges build TE's spec only, which needs TE and CUDA).
`--batch-invariant` turns on megatron's batch_invariant_mode (TE and FlashAttention
3 or 4 only; refused at start-up otherwise, support/layer_spec.py); with `--old-log-prob-micro-batch` the old
log-probs come in another packing than the update's, as verl's log_prob_micro_batch_size_per_gpu does, and the
report then checks every step exactly on-policy (actor/ppo_kl and actor/pg_clipfrac 0). verl's `load_checkpoint`
runs inside `support.train_engine.load_checkpoint_for_resume`, which works around two faults
of megatron-core's distributed optimizer on PyTorch's Adam (used without Apex or
TE): a fresh optimizer cannot be loaded into (its state is primed with zeros
first), and the load leaves each parameter's Adam step at 0 (it is set from the
restored param groups afterwards). The LR scheduler is checkpointed
(`use_checkpoint_opt_param_scheduler=True`). Trainer-level code (Ray workers,
rollout) is not used: this tool calls the engine methods verl's `TrainingWorker`
calls.

On the CPU (gloo; any TP size, and `--pp`/`--ep` for pipeline and expert
parallelism: one process per TP x PP x EP rank, EP with an MoE config such as
configs/tiny_qwen3_moe) Triton cannot run: legacy's kernel is swapped for
the portable op (`stand_ins/legacy_kernel_swap.py`), "auto" is the portable op,
and megatron-core's optimizer runs on CPU tensors through a named fake
(`stand_ins/cuda_on_cpu.py`: its CUDA-only scalar placement and type checks);
hook-verl is skipped. On the CPU offload runs verl's functions, but the
"device" they load to is the CPU itself. On CUDA (one GPU, TP=1) every step
runs bitwise repeatable (`support/determinism.py`).

Identities checked (exit status 1 when one fails; train/report.py):
legacy and the mode that computes with legacy's kernel (hook-verl on CUDA,
hook-auto on the CPU) identical at every step (loss, gradient norm, checksum);
in every mode the resumed steps identical to the uninterrupted ones and the
offload run identical to the plain one. Modes with another kernel are reported
with their gap to legacy per step and held to bounds; hook-auto-fused-loss
also to hook-auto, whose forward kernel family it shares.

Never losing finished work: the report (JSON, markdown, plot) is rewritten
after every finished run, so a process killed by a time limit leaves every
finished run on disk. `--merge DIR [DIR ...]` combines the reports of several
invocations of one configuration (say one device call per group of modes, one
for offload on with `--no-resume`) into --out and evaluates every identity
across them; checks whose runs are missing are listed as pending.

Usage: verl-fused-hook train-parity [--device cpu|cuda] [--tp N] [--pp N] [--ep N] [--hf-config PATH] [--steps K]
         [--prompts P] [--n 5] [--prompt-lengths LO,HI] [--response-lengths LO,HI] [--micro-batch M]
         [--old-log-prob-micro-batch M]
         [--modes legacy,hook-auto,...] [--offload both|off|on] [--offload-modes MODES] [--no-resume]
         [--nondeterministic] [--dtype bf16|fp32] [--seed S] [--layer-spec auto|local|te]
         [--bridge mbridge|megatron-bridge] [--batch-invariant]
         [--out DIR] [--verbose]
       verl-fused-hook train-parity --merge DIR [DIR ...] --out DIR
Writes DIR/train_parity.json, DIR/train_parity.md and DIR/train_parity.png (loss curves; skipped with a log
line when matplotlib is missing). Checkpoints go to a temporary folder (under $TRAIN_PARITY_CHECKPOINT_DIR when
set), removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ...support.arguments import DTYPES, add_device_argument, default_dtype, known_names, resolve_device
from ...support.grpo_batches import RolloutShape
from ...support.hf_model import QWEN2_5_0_5B, TINY_QWEN2, config_folder, load_hf_config
from ...support.layer_spec import (
    BRIDGES,
    MBRIDGE,
    add_layer_spec_arguments,
    check_batch_invariant,
    check_bridge,
    resolve_layer_spec,
)
from ...support.upstream_notices import UpstreamNotices, add_verbose_argument
from . import report as report_file
from .modes import MODES
from .runs import Plan, resumed_worker, run_group, uninterrupted_worker


def _pair(text: str, field: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{field}: expected LO,HI (two integers), got {text!r}") from None
    return low, high


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_argument(parser)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (CPU: gloo processes; CUDA: 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (CPU only: gloo processes)")
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size (CPU only, an MoE --hf-config such as "
        "verl_fused_hook_harness/configs/tiny_qwen3_moe; data-parallel ranks = EP)",
    )
    parser.add_argument(
        "--hf-config",
        default=None,
        help="HF config.json or folder (default: CPU the shipped tiny "
        "Qwen2, CUDA the shipped Qwen2.5-0.5B-shaped config)",
    )
    parser.add_argument("--steps", type=int, default=None, help="K (even, >= 2; default 20 on CUDA, 4 on the CPU)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default 4 CUDA, 2 CPU)")
    parser.add_argument("--n", type=int, default=5, help="responses per prompt")
    parser.add_argument("--prompt-lengths", default=None, help="LO,HI tokens (default 64,256 CUDA, 3,9 CPU)")
    parser.add_argument("--response-lengths", default=None, help="LO,HI tokens (default 128,512 CUDA, 2,10 CPU)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default 5)")
    parser.add_argument(
        "--old-log-prob-micro-batch",
        type=int,
        default=None,
        help="sequences per micro-batch of the old log-probs (verl's log_prob_micro_batch_size_per_gpu; default: "
        "--micro-batch's). With --batch-invariant the report checks that every step is exactly on-policy "
        "(actor/ppo_kl and actor/pg_clipfrac 0)",
    )
    parser.add_argument(
        "--modes", default=None, help=f"comma-separated, from {', '.join(MODES)} (default: all the device runs)"
    )
    parser.add_argument(
        "--offload", choices=("both", "off", "on"), default="both", help="verl's param/grad/optimizer offload"
    )
    parser.add_argument(
        "--offload-modes",
        default=None,
        help="with --offload both: the modes that also run with offload on (default: every mode)",
    )
    parser.add_argument(
        "--no-resume",
        action="store_true",
        help="skip the checkpoint and the resumed runs (e.g. a "
        "call that only adds offload-on runs to be merged with one that resumed)",
    )
    parser.add_argument(
        "--nondeterministic",
        action="store_true",
        help="CUDA: PyTorch's default (faster, not "
        "bitwise repeatable) algorithms; identities are then not expected to hold",
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--seed", type=int, default=1234)
    add_layer_spec_arguments(parser)
    parser.add_argument(
        "--bridge",
        choices=BRIDGES,
        default=MBRIDGE,
        help="verl's model builder: mbridge (vanilla_mbridge=True; the default here, and the one the local spec's "
        "stand-in builds through) or megatron-bridge (verl 0.9.1's default; --layer-spec te, needs the "
        "megatron-bridge package and Transformer Engine)",
    )
    parser.add_argument(
        "--out",
        default="train_parity",
        help="folder for train_parity.{json,md,png}, rewritten after every finished run",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="DIR",
        default=None,
        help="no training: combine the reports "
        "in these folders (one configuration, e.g. several device calls) into --out and evaluate "
        "every identity across them",
    )
    add_verbose_argument(parser)
    return parser


def parse_plan(argv, checkpoint_root: str) -> tuple[Plan, Path]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.merge is not None:
        parser.error("--merge: use main(); parse_plan builds a training run")
    return plan_from_args(parser, args, checkpoint_root), Path(args.out)


def plan_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, checkpoint_root: str) -> Plan:
    device = resolve_device(parser, args.device)
    cuda = device == "cuda"
    if cuda and args.tp != 1:
        parser.error(f"--tp {args.tp}: on CUDA this command runs on one GPU (TP=1)")
    for flag, size in (("--tp", args.tp), ("--pp", args.pp), ("--ep", args.ep)):
        if size < 1:
            parser.error(f"{flag} {size}: expected >= 1")
    if cuda and (args.pp > 1 or args.ep > 1):
        parser.error("--pp/--ep: on CUDA this command runs on one GPU; pipeline and expert parallelism run on the CPU")
    layer_spec = resolve_layer_spec(parser, args.layer_spec, device).spec
    check_batch_invariant(parser, args.batch_invariant, layer_spec)
    check_bridge(parser, args.bridge, layer_spec)
    steps = args.steps if args.steps is not None else (20 if cuda else 4)
    if steps < 2 or steps % 2:
        parser.error(f"--steps {steps}: expected an even number >= 2 (the checkpoint is taken after step K/2)")
    try:
        hf_path = config_folder(args.hf_config or (QWEN2_5_0_5B if cuda else TINY_QWEN2))
    except ValueError as error:
        parser.error(f"--hf-config: {error}")
    if args.modes:
        modes = tuple(known_names(parser, "--modes", args.modes, MODES))
        if not cuda and any(MODES[m].cuda_only for m in modes):
            parser.error("--modes: hook-verl runs verl's Triton kernel and needs CUDA")
    else:
        modes = tuple(m.name for m in MODES.values() if cuda or not m.cuda_only)
    try:
        shape = RolloutShape(
            prompts=args.prompts or (4 if cuda else 2),
            n=args.n,
            prompt_lengths=_pair(args.prompt_lengths or ("64,256" if cuda else "3,9"), "--prompt-lengths"),
            response_lengths=_pair(args.response_lengths or ("128,512" if cuda else "2,10"), "--response-lengths"),
        )
    except (ValueError, argparse.ArgumentTypeError) as error:
        parser.error(str(error))
    micro_batch = args.micro_batch or 5
    if shape.sequences % micro_batch:
        parser.error(f"--micro-batch {micro_batch}: must divide prompts*n = {shape.sequences}")
    old_micro = args.old_log_prob_micro_batch
    if old_micro is not None and (old_micro < 1 or shape.sequences % old_micro):
        parser.error(f"--old-log-prob-micro-batch {old_micro}: must be >= 1 and divide prompts*n = {shape.sequences}")
    experts = getattr(load_hf_config(hf_path), "num_experts", None) or 0
    if args.ep > 1 and (not experts or experts % args.ep):
        parser.error(f"--ep {args.ep}: needs an MoE --hf-config whose experts divide by it (this one has {experts})")
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.dtype or default_dtype(device)]  # verl's names
    offload = {"both": (False, True), "off": (False,), "on": (True,)}[args.offload]
    offload_modes = tuple(args.offload_modes.split(",")) if args.offload_modes else modes
    if any(m not in modes for m in offload_modes):
        parser.error(f"--offload-modes: {[m for m in offload_modes if m not in modes]} not among --modes {list(modes)}")
    plan = Plan(
        hf_path=hf_path,
        device=device,
        tp=args.tp,
        dtype=dtype,
        steps=steps,
        shape=shape,
        micro_batch=micro_batch,
        seed=args.seed,
        modes=modes,
        offload=offload,
        offload_modes=offload_modes,
        deterministic=not args.nondeterministic,
        checkpoint_root=checkpoint_root,
        out=args.out,
        resume=not args.no_resume,
        pp=args.pp,
        ep=args.ep,
        layer_spec=layer_spec,
        bridge=args.bridge,
        batch_invariant=args.batch_invariant,
        old_log_prob_micro_batch=old_micro,
    )
    return plan


def _finish(report: dict, out: Path) -> int:
    """Print the report's tables and verdict; exit status 1 when a check failed."""
    print(report_file.markdown(report))
    evaluation = report["evaluation"]
    if not evaluation["match"]:
        print(f"FAIL: see the checks above (report in {out})", flush=True)
        return 1
    if evaluation["pending"]:
        print(
            f"PASS for the {len(evaluation['checks'])} checks these runs allow; {len(evaluation['pending'])} need "
            f"runs of another call (listed above), then `--merge` the reports",
            flush=True,
        )
        return 0
    print("PASS", flush=True)
    return 0


def merge_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    given = sorted(
        k for k, v in vars(args).items() if k not in ("merge", "out", "verbose") and v != parser.get_default(k)
    )
    if given:
        parser.error(
            f"--merge reads finished reports; {', '.join('--' + k.replace('_', '-') for k in given)} "
            "apply to training runs only"
        )
    try:
        merged = report_file.merge([(folder, report_file.read(Path(folder))) for folder in args.merge])
    except ValueError as error:
        parser.error(str(error))
    out = Path(args.out)
    report_file.write(merged, out)
    print(f"train-parity: merged {len(merged['runs'])} runs from {', '.join(args.merge)} into {out}", flush=True)
    return _finish(merged, out)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with UpstreamNotices(verbose=args.verbose):
        return merge_main(parser, args) if args.merge is not None else train(parser, args)


def train(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Every run the arguments ask for, the report rewritten after each; exit status from its checks."""
    checkpoint_root = tempfile.mkdtemp(prefix="train_parity_ckpt_", dir=os.environ.get("TRAIN_PARITY_CHECKPOINT_DIR"))
    try:
        plan = plan_from_args(parser, args, checkpoint_root)
        out = Path(plan.out)
        if (out / report_file.REPORT_NAME).exists():
            print(f"train-parity: replacing the report in {out} (give another --out to keep it)", flush=True)
        report_file.write(report_file.new_report(plan.configuration()), out)
        print(
            f"train-parity on {plan.device}, TP={plan.tp}, PP={plan.pp}, EP={plan.ep}, {plan.dtype}, {plan.steps} "
            f"steps, {plan.layer_spec} layer spec built through {plan.bridge}"
            f"{', batch-invariant' if plan.batch_invariant else ''}, modes "
            f"{', '.join(plan.modes)}; {plan.shape.prompts} prompts x {plan.shape.n} responses per step, "
            f"micro-batches of {plan.micro_batch}; model {plan.hf_path}; report {out} (after every run)",
            flush=True,
        )
        run_group(uninterrupted_worker, plan)
        if plan.resume:
            run_group(resumed_worker, plan)
    finally:
        shutil.rmtree(checkpoint_root, ignore_errors=True)
    return _finish(report_file.read(out), out)


if __name__ == "__main__":
    sys.exit(main())
