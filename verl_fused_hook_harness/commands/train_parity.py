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

Modes (train_parity_modes.py): legacy (VERL_FUSED_USE_OP_HOOK=0, verl's
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
except `_build_megatron_module`: verl builds through mbridge, which hard-codes
Transformer Engine's layer spec, and TE is not installable here; the stand-in
(`testing/train_engine.py`) calls verl's own `get_model` with a provider that
builds the GPTModel with megatron-core's local spec and seeded random weights
(verl would load a checkpoint). verl's `load_checkpoint` runs inside
`testing.train_engine.load_checkpoint_for_resume`, which works around two faults
of megatron-core's distributed optimizer on PyTorch's Adam (used without Apex or
TE): a fresh optimizer cannot be loaded into (its state is primed with zeros
first), and the load leaves each parameter's Adam step at 0 (it is set from the
restored param groups afterwards). The LR scheduler is checkpointed
(`use_checkpoint_opt_param_scheduler=True`). Trainer-level code (Ray workers,
rollout) is not used: this tool calls the engine methods verl's `TrainingWorker`
calls.

On the CPU (gloo; any TP size) Triton cannot run: legacy's kernel is swapped for
the portable op (`testing/legacy_kernel_swap.py`), "auto" is the portable op,
and megatron-core's optimizer runs on CPU tensors through a named fake
(`testing/cuda_on_cpu.py`: its CUDA-only scalar placement and type checks);
hook-verl is skipped. On the CPU offload runs verl's functions, but the
"device" they load to is the CPU itself. On CUDA (one GPU, TP=1) every step
runs bitwise repeatable (`testing/determinism.py`).

Identities checked (exit status 1 when one fails; train_parity_report.py):
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

Usage: verl-fused-hook train-parity [--device cpu|cuda] [--tp N] [--hf-config PATH] [--steps K]
         [--prompts P] [--n 5] [--prompt-lengths LO,HI] [--response-lengths LO,HI] [--micro-batch M]
         [--modes legacy,hook-auto,...] [--offload both|off|on] [--offload-modes MODES] [--no-resume]
         [--nondeterministic] [--dtype bf16|fp32] [--seed S] [--out DIR]
       verl-fused-hook train-parity --merge DIR [DIR ...] --out DIR
Writes DIR/train_parity.json, DIR/train_parity.md and DIR/train_parity.png (loss curves; skipped with a log
line when matplotlib is missing). Checkpoints go to a temporary folder (under $TRAIN_PARITY_CHECKPOINT_DIR when
set), removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..support.grpo_batches import RolloutShape
from . import train_parity_report as report_file
from .train_parity_modes import MODES, Mode, fused_kernel_options

ENV_VAR = "VERL_FUSED_USE_OP_HOOK"
TEMPERATURE = 1.0
ENTROPY_COEF = 0.01
KL_COEF = 0.001
LR = 1e-4
QWEN2_5_0_5B = Path(__file__).resolve().parents[1] / "configs" / "qwen2_5_0_5b"


@dataclass(frozen=True)
class Plan:
    """Everything every process of a run needs (picklable)."""

    hf_path: str
    device: str
    tp: int
    dtype: str  # "bfloat16" or "float32"
    steps: int
    shape: RolloutShape
    micro_batch: int
    seed: int
    modes: tuple[str, ...]
    offload: tuple[bool, ...]
    offload_modes: tuple[str, ...]  # the modes that also run with offload on, when offload includes True
    deterministic: bool  # CUDA: bitwise-repeatable steps (testing/determinism.py)
    checkpoint_root: str
    out: str  # the report's folder: every finished run is added to it at once
    resume: bool = True  # run the resumed half (fresh processes, the checkpoint of the first offload setting)

    @property
    def checkpoint_step(self) -> int:
        return self.steps // 2

    def checkpoint_dir(self, mode: str) -> str:
        return os.path.join(self.checkpoint_root, mode)

    def configuration(self) -> dict:
        """What must agree between two reports for their runs to be compared (train_parity_report)."""
        return {
            "device": self.device, "tp": self.tp, "dtype": self.dtype, "steps": self.steps,
            "hf_config": config_identity(Path(self.hf_path)),
            "shape": asdict(self.shape), "micro_batch": self.micro_batch, "seed": self.seed,
            "checkpoint_step": self.checkpoint_step, "deterministic": self.deterministic,
        }  # fmt: skip


# ---------------------------------------------------------------- one mode's engines


@contextlib.contextmanager
def mode_context(mode: Mode, device: str):
    """The kernel legacy computes with (portable op on the CPU), and on the CPU the fakes that let megatron's
    optimizer run there (stand_ins/cuda_on_cpu.py). hook-auto (no mask) is what hook mode does for a loss
    that may read every row: its engines are built with `output_processor_score_mask=false`."""
    from verl_fused_hook_harness.stand_ins.cuda_on_cpu import cuda_names_on_cpu
    from verl_fused_hook_harness.stand_ins.legacy_kernel_swap import portable_legacy_kernel

    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_names_on_cpu())  # CPU only: megatron's optimizer and verl's memory logs (fakes)
        if not mode.hook and device == "cpu":
            stack.enter_context(portable_legacy_kernel("torch"))
        yield


def fused_loss_forwards(engine) -> int:
    """How many engine forwards of `engine` computed their loss inside the op (the plugin's own count): the
    report's proof that a fused-loss mode ran verl's ppo_loss inside the op, and that no other mode did."""
    from verl_fused_hook.verl_integration.model_plan import counts_of

    return sum(counts_of(model).fused_loss_forwards for model in engine.module)


def _engines(plan: Plan, mode: Mode, offload: bool):
    """(actor, reference) engines of one mode; the environment switch is read by verl's build step."""
    from verl_fused_hook_harness.support.train_engine import EngineSetup, build_engine

    os.environ[ENV_VAR] = "1" if mode.hook else "0"
    options = fused_kernel_options(mode)
    setup = EngineSetup(
        hf_path=plan.hf_path,
        tp=plan.tp,
        dtype=plan.dtype,
        seed=plan.seed,
        micro_batch_size=plan.micro_batch,
        total_steps=plan.steps,
        lr=LR,
        offload=offload,
        fused_kernel_options=options,
    )
    actor = build_engine(setup)
    reference = build_engine(replace(setup, offload=False), forward_only=True)
    return actor, reference


def _loss_function(plan: Plan):
    """verl's ppo_loss with the actor config a GRPO run uses (clipped PG, entropy bonus, low-var KL)."""
    import functools

    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    config = McoreActorConfig(
        ppo_mini_batch_size=plan.shape.prompts,
        ppo_micro_batch_size_per_gpu=plan.micro_batch,
        use_dynamic_bsz=False,
        entropy_coeff=ENTROPY_COEF,
        use_kl_loss=True,
        kl_loss_coef=KL_COEF,
        kl_loss_type="low_var_kl",
        loss_agg_mode="token-mean",
        rollout_n=plan.shape.n,
    )
    return functools.partial(ppo_loss, config=config)


# ---------------------------------------------------------------- one step


def _engine_keys(plan: Plan) -> dict:
    """The non-tensor entries verl's TrainingWorker adds to every batch."""
    return dict(
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=plan.micro_batch,
        use_fused_kernels=True,
    )


def _log_probs(engine, fields, plan: Plan, *, entropy: bool):
    """Forward-only log-probs as the trainer computes old/reference log-probs, padded [batch, response]."""
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_fused_hook_harness.support.grpo_batches import packed

    data = packed(fields, TEMPERATURE, calculate_entropy=entropy, compute_loss=False, **_engine_keys(plan))
    with engine.eval_mode():
        output = engine.infer_batch(data, loss_function=None)
    return no_padding_2_padding(output["model_output"]["log_probs"], data).float().cpu()


def parameter_checksum(engine) -> tuple[str, float]:
    """A 64-bit checksum of every parameter's bits on this rank (model order) and their float64 sum.

    Computed where the parameters live: each parameter's bit pattern (as integers) times position-dependent
    odd weights, summed in int64 (integer sums are exact and order-free, so the checksum is deterministic),
    chained over parameters. Any changed bit changes it (up to 2**-64 collisions); copying 0.5B parameters to
    the host for a cryptographic hash would cost more than a training step."""
    integer_of = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    chained, total = 0, 0.0
    for chunk in engine.module:
        for param in chunk.parameters():
            data = param.detach().contiguous().reshape(-1)
            bits = data.view(integer_of[data.element_size()]).to(torch.int64)
            weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) * 2654435761 + 40503
            chained = (chained * 1_000_003 + int((bits * weights).sum())) % 2**64
            total += data.double().sum().item()
    return f"{chained:016x}", total


def train_step(actor, reference, loss_function, plan: Plan, step: int) -> dict:
    """One GRPO step (rollout, old and reference log-probs, actor update, LR step); this rank's numbers."""
    from verl_fused_hook_harness.support.grpo_batches import packed, rollout

    device = plan.device
    allocated = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()
    started = time.perf_counter()
    fields = rollout(plan.shape, actor.model_config.hf_config.vocab_size, plan.seed, step)
    fields["old_log_probs"] = _log_probs(actor, fields, plan, entropy=True)
    fields["ref_log_prob"] = _log_probs(reference, fields, plan, entropy=False)
    data = packed(
        fields, TEMPERATURE, calculate_entropy=True, global_batch_size=plan.shape.sequences, **_engine_keys(plan)
    )
    with actor.train_mode():
        calls_before = fused_loss_forwards(actor)
        output = actor.train_batch(data, loss_function=loss_function)
        update_fused_loss_calls = fused_loss_forwards(actor) - calls_before
        checksum_started = time.perf_counter()
        checksum, total = parameter_checksum(actor)  # inside: with offload on, parameters leave on exit
        checksum_seconds = time.perf_counter() - checksum_started
    actor.lr_scheduler_step()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started - checksum_seconds  # the step, not our checksum
    losses = output["loss"]
    grad_norm = output["metrics"].get("grad_norm")
    return {
        "step": step,
        "loss": float(sum(losses) if isinstance(losses, list) else losses),
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "param_checksum": checksum,
        "param_sum": total,
        "old_log_prob_sum": float(fields["old_log_probs"].double().sum()),
        "fused_loss_calls": update_fused_loss_calls,  # micro-batches whose ppo_loss ran inside the op
        "seconds": seconds,
        "peak_bytes": int(torch.cuda.max_memory_allocated()) if device == "cuda" else None,
        "allocated_bytes_at_start": allocated,  # weights, grads and optimizer state held between steps
    }


# ---------------------------------------------------------------- one process group


def _prepare_process(plan: Plan, rank: int) -> None:
    from verl_fused_hook.verl_integration import install

    install()  # what `import verl` does through the entry point when the package is installed
    if rank != 0:
        logging.getLogger("verl_fused_hook").setLevel(logging.WARNING)
    if plan.device == "cpu":
        from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel

        init_model_parallel(plan.tp, seed=plan.seed)  # the engine then finds megatron's state set up


def _run_steps(plan: Plan, mode: Mode, offload: bool, first: int, save: bool, load: bool) -> tuple[list[dict], dict]:
    """One run's step rows and where its wall time went (engine builds, checkpoint save or load)."""
    from verl_fused_hook_harness.support.determinism import deterministic_steps
    from verl_fused_hook_harness.support.train_engine import load_checkpoint_for_resume

    started = time.perf_counter()
    info = {"build_s": None, "save_s": None, "load_s": None}
    with mode_context(mode, plan.device):
        actor, reference = _engines(plan, mode, offload)
        info["build_s"] = time.perf_counter() - started
        if load:
            loading = time.perf_counter()
            load_checkpoint_for_resume(actor, plan.checkpoint_dir(mode.name))
            info["load_s"] = time.perf_counter() - loading
        loss_function = _loss_function(plan)
        repeatable = (
            deterministic_steps(*actor.module, *reference.module)
            if plan.device == "cuda" and plan.deterministic
            else contextlib.nullcontext()
        )
        rows = []
        with repeatable:
            for step in range(first, plan.steps + 1):
                rows.append(train_step(actor, reference, loss_function, plan, step))
                if save and step == plan.checkpoint_step:
                    saving = time.perf_counter()
                    actor.save_checkpoint(plan.checkpoint_dir(mode.name), global_step=step)
                    info["save_s"] = time.perf_counter() - saving
    _release(actor, reference)
    info["wall_s"] = time.perf_counter() - started
    return rows, info


def _release(*engines) -> None:
    """Free one mode's engines before the next mode builds its own (megatron's parallel state stays)."""
    import gc

    for engine in engines:
        engine.module = engine.optimizer = engine.lr_scheduler = None
        engine.checkpoint_mananager = None  # sic: verl's spelling
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_line(key: str, rows: list[dict], info: dict) -> str:
    """What a finished run prints: its wall time and where it went."""
    parts = [f"build {info['build_s']:.1f}s"]
    if info.get("load_s") is not None:
        parts.append(f"checkpoint load {info['load_s']:.1f}s")
    parts.append(f"first step {rows[0]['seconds']:.2f}s")
    if len(rows) > 1:
        later = [r["seconds"] for r in rows[1:]]
        parts.append(f"steps {rows[1]['step']}-{rows[-1]['step']} mean {sum(later) / len(later):.3f}s")
    if info.get("save_s") is not None:
        parts.append(f"checkpoint save {info['save_s']:.1f}s")
    return f"[{key}] steps {rows[0]['step']}-{rows[-1]['step']} in {info['wall_s']:.1f}s ({', '.join(parts)})"


def _record(plan: Plan, rank: int, world_size: int, key: str, rows: list[dict], info: dict) -> None:
    """Add a finished run (every rank's checksums combined) to the report on disk and say so."""
    import torch.distributed as dist

    per_rank = [None] * world_size
    if world_size > 1:
        dist.all_gather_object(per_rank, rows)
    else:
        per_rank = [rows]
    if rank == 0:
        merged = report_file.merge_ranks([{key: r} for r in per_rank])
        report_file.add_runs(Path(plan.out), merged, {key: info})
        print(run_line(key, rows, info), flush=True)


def uninterrupted_worker(rank: int, world_size: int, plan: Plan) -> None:
    """Every mode, K steps from the start, for each offload setting (saving the checkpoint at K/2 in the first)."""
    _prepare_process(plan, rank)
    for name in plan.modes:
        for offload in plan.offload:
            if offload and name not in plan.offload_modes:
                continue
            key = f"{name}/offload-{'on' if offload else 'off'}"
            # the checkpoint comes from the first offload setting, the one the resumed run uses
            save = plan.resume and offload == plan.offload[0]
            rows, info = _run_steps(plan, MODES[name], offload, first=1, save=save, load=False)
            _record(plan, rank, world_size, key, rows, info)


def resumed_worker(rank: int, world_size: int, plan: Plan) -> None:
    """Every mode in a fresh process group: load the step-K/2 checkpoint, run steps K/2+1..K."""
    _prepare_process(plan, rank)
    origin = f"offload-{'on' if plan.offload[0] else 'off'}"
    for name in plan.modes:
        rows, info = _run_steps(plan, MODES[name], plan.offload[0], first=plan.checkpoint_step + 1, save=False, load=True)
        _record(plan, rank, world_size, f"{name}/resumed", rows, info | {"resumes": f"{name}/{origin}"})


def run_group(worker, plan: Plan) -> None:
    """`worker` in fresh processes (gloo on the CPU, one per TP rank; NCCL on one GPU); it records its own runs."""
    if plan.device == "cpu":
        from verl_fused_hook_harness.support.distributed import run_on_gloo

        run_on_gloo(worker, plan.tp, plan)
        return
    import torch.multiprocessing as mp

    from verl_fused_hook_harness.support.distributed import free_port

    mp.start_processes(_nccl_worker, args=(free_port(), worker, plan), nprocs=1, start_method="spawn")


def _nccl_worker(rank, port, worker, plan):
    import torch.distributed as dist

    from verl_fused_hook_harness.support.determinism import prepare_cublas_workspace

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    prepare_cublas_workspace()  # before the first GEMM: deterministic steps need it
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        worker(0, 1, plan)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- command line


def _pair(text: str, field: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{field}: expected LO,HI (two integers), got {text!r}") from None
    return low, high


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when a GPU is there")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (CPU: gloo processes; CUDA: 1)")
    parser.add_argument("--hf-config", default=None, help="HF config.json or folder (default: CPU the shipped tiny "
                        "Qwen2, CUDA the shipped Qwen2.5-0.5B-shaped config)")
    parser.add_argument("--steps", type=int, default=None, help="K (even, >= 2; default 20 on CUDA, 4 on the CPU)")
    parser.add_argument("--prompts", type=int, default=None, help="prompts per step (default 4 CUDA, 2 CPU)")
    parser.add_argument("--n", type=int, default=5, help="responses per prompt")
    parser.add_argument("--prompt-lengths", default=None, help="LO,HI tokens (default 64,256 CUDA, 3,9 CPU)")
    parser.add_argument("--response-lengths", default=None, help="LO,HI tokens (default 128,512 CUDA, 2,10 CPU)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default 5)")
    parser.add_argument("--modes", default=None, help=f"comma-separated, from {', '.join(MODES)} (default: all the device runs)")
    parser.add_argument("--offload", choices=("both", "off", "on"), default="both", help="verl's param/grad/optimizer offload")
    parser.add_argument("--offload-modes", default=None, help="with --offload both: the modes that also run with "
                        "offload on (default: every mode)")
    parser.add_argument("--no-resume", action="store_true", help="skip the checkpoint and the resumed runs (e.g. a "
                        "call that only adds offload-on runs to be merged with one that resumed)")
    parser.add_argument("--nondeterministic", action="store_true", help="CUDA: PyTorch's default (faster, not "
                        "bitwise repeatable) algorithms; identities are then not expected to hold")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="train_parity", help="folder for train_parity.{json,md,png}, rewritten "
                        "after every finished run")
    parser.add_argument("--merge", nargs="+", metavar="DIR", default=None, help="no training: combine the reports "
                        "in these folders (one configuration, e.g. several device calls) into --out and evaluate "
                        "every identity across them")
    return parser


def parse_plan(argv, checkpoint_root: str) -> tuple[Plan, Path]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.merge is not None:
        parser.error("--merge: use main(); parse_plan builds a training run")
    return plan_from_args(parser, args, checkpoint_root), Path(args.out)


def config_identity(hf_path: Path) -> str:
    """The model config's name and a hash of its contents: the same model wherever the repository sits."""
    file = hf_path / "config.json" if hf_path.is_dir() else hf_path
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:12]
    return f"{file.parent.name} (config.json sha256 {digest})"


def plan_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace, checkpoint_root: str) -> Plan:
    from verl_fused_hook_harness.support.hf_model import TINY_QWEN2

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    if cuda and args.tp != 1:
        parser.error(f"--tp {args.tp}: on CUDA this command runs on one GPU (TP=1)")
    if args.tp < 1:
        parser.error(f"--tp {args.tp}: expected >= 1")
    steps = args.steps if args.steps is not None else (20 if cuda else 4)
    if steps < 2 or steps % 2:
        parser.error(f"--steps {steps}: expected an even number >= 2 (the checkpoint is taken after step K/2)")
    hf_path = Path(args.hf_config) if args.hf_config else (QWEN2_5_0_5B if cuda else TINY_QWEN2)
    if not hf_path.exists():
        parser.error(f"--hf-config: {hf_path} does not exist; pass a config.json or a folder holding one")
    if args.modes:
        modes = tuple(args.modes.split(","))
        unknown = [m for m in modes if m not in MODES]
        if unknown:
            parser.error(f"--modes: unknown {unknown}; allowed: {', '.join(MODES)}")
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
    dtype = {"bf16": "bfloat16", "fp32": "float32"}[args.dtype or ("bf16" if cuda else "fp32")]
    offload = {"both": (False, True), "off": (False,), "on": (True,)}[args.offload]
    offload_modes = tuple(args.offload_modes.split(",")) if args.offload_modes else modes
    if any(m not in modes for m in offload_modes):
        parser.error(f"--offload-modes: {[m for m in offload_modes if m not in modes]} not among --modes {list(modes)}")
    plan = Plan(
        hf_path=str(hf_path.parent if hf_path.is_file() else hf_path),
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
        print(f"PASS for the {len(evaluation['checks'])} checks these runs allow; {len(evaluation['pending'])} need "
              f"runs of another call (listed above), then `--merge` the reports", flush=True)
        return 0
    print("PASS", flush=True)
    return 0


def merge_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    given = sorted(k for k, v in vars(args).items() if k not in ("merge", "out") and v != parser.get_default(k))
    if given:
        parser.error(f"--merge reads finished reports; {', '.join('--' + k.replace('_', '-') for k in given)} "
                     "apply to training runs only")
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
    if args.merge is not None:
        return merge_main(parser, args)
    checkpoint_root = tempfile.mkdtemp(prefix="train_parity_ckpt_", dir=os.environ.get("TRAIN_PARITY_CHECKPOINT_DIR"))
    try:
        plan = plan_from_args(parser, args, checkpoint_root)
        out = Path(plan.out)
        if (out / report_file.REPORT_NAME).exists():
            print(f"train-parity: replacing the report in {out} (give another --out to keep it)", flush=True)
        report_file.write(report_file.new_report(plan.configuration()), out)
        print(f"train-parity on {plan.device}, TP={plan.tp}, {plan.dtype}, {plan.steps} steps, modes "
              f"{', '.join(plan.modes)}; {plan.shape.prompts} prompts x {plan.shape.n} responses per step, "
              f"micro-batches of {plan.micro_batch}; model {plan.hf_path}; report {out} (after every run)", flush=True)
        run_group(uninterrupted_worker, plan)
        if plan.resume:
            run_group(resumed_worker, plan)
    finally:
        shutil.rmtree(checkpoint_root, ignore_errors=True)
    return _finish(report_file.read(out), out)


if __name__ == "__main__":
    sys.exit(main())
