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

Modes: legacy (VERL_FUSED_USE_OP_HOOK=0, verl's monkey-patched forward),
hook-verl (hook, backend verl: verl's Triton kernel; CUDA only), hook-auto
(hook, backend auto: this package's kernel, score mask off) and hook-auto-mask
(hook, backend auto, score mask on: only the rows `ppo_loss` reads are computed,
the plugin's default for ppo_loss steps). Per step: the loss (sum over
micro-batches, as verl's worker reports it), the gradient norm (from the
optimizer step), a checksum of every parameter's bits on every rank (and the
float64 sum), step time and peak memory.

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

Identities checked (exit status 1 when one fails): legacy and the mode that
computes with legacy's kernel (hook-verl on CUDA, hook-auto on the CPU)
identical at every step (loss, gradient norm, checksum); in every mode the
resumed steps identical to the uninterrupted ones and the offload run
identical to the plain one. Modes with another kernel (hook-auto on CUDA,
hook-auto-mask) are reported with their largest gap to legacy and held to
the bounds below.

Usage: verl-fused-hook train-parity [--device cpu|cuda] [--tp N] [--hf-config PATH] [--steps K]
         [--prompts P] [--n 5] [--prompt-lengths LO,HI] [--response-lengths LO,HI] [--micro-batch M]
         [--modes legacy,hook-auto,...] [--offload both|off|on] [--offload-modes MODES] [--nondeterministic]
         [--dtype bf16|fp32] [--seed S] [--out DIR]
Writes DIR/train_parity.json, DIR/train_parity.md and DIR/train_parity.png (loss curves). Checkpoints go to a
temporary folder (under $TRAIN_PARITY_CHECKPOINT_DIR when set), removed at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..testing.grpo_batches import RolloutShape

ENV_VAR = "VERL_FUSED_USE_OP_HOOK"
TEMPERATURE = 1.0
ENTROPY_COEF = 0.01
KL_COEF = 0.001
LR = 1e-4
# Modes with another kernel than legacy's (hook-auto on CUDA; hook-auto-mask where the mask changes the rounding):
# per step, the absolute loss gap (GRPO losses sit near 0, so a relative gap means nothing) and the gradient
# norm's gap relative to legacy's. Bounds for a sanity check, not a claim: each kernel's log-probs are within
# 3e-5 of fp64 (docs/benchmarks.md), and over K optimizer steps bf16 parameters round every update, so the
# runs drift apart a little each step; the tool reports the gap per step next to the bound.
TWO_KERNEL_LOSS_ATOL = {"float32": 1e-4, "bfloat16": 2e-2}
TWO_KERNEL_GRAD_NORM_RTOL = {"float32": 1e-3, "bfloat16": 5e-2}
QWEN2_5_0_5B = Path(__file__).resolve().parents[1] / "configs" / "qwen2_5_0_5b"


@dataclass(frozen=True)
class Mode:
    name: str
    hook: bool
    backend: str | None
    score_mask: bool
    cuda_only: bool = False


MODES = {
    m.name: m
    for m in (
        Mode("legacy", hook=False, backend=None, score_mask=False),
        Mode("hook-verl", hook=True, backend="verl", score_mask=False, cuda_only=True),
        Mode("hook-auto", hook=True, backend="auto", score_mask=False),
        Mode("hook-auto-mask", hook=True, backend="auto", score_mask=True),
    )
}


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

    @property
    def checkpoint_step(self) -> int:
        return self.steps // 2

    def checkpoint_dir(self, mode: str) -> str:
        return os.path.join(self.checkpoint_root, mode)


# ---------------------------------------------------------------- one mode's engines


@contextlib.contextmanager
def mode_context(mode: Mode, device: str):
    """The kernel legacy computes with (portable op on the CPU), the score-mask switch for hook-auto, and on
    the CPU the fakes that let megatron's optimizer run there (testing/cuda_on_cpu.py).

    hook-auto (no mask) is what hook mode does for a loss that may read every row: the plugin's
    row selection is turned off for this mode by making `response_score_rows` answer "every row"."""
    from verl_fused_hook.testing.cuda_on_cpu import cuda_names_on_cpu
    from verl_fused_hook.testing.legacy_kernel_swap import portable_legacy_kernel
    from verl_fused_hook.verl_integration import step_scoring

    with contextlib.ExitStack() as stack:
        stack.enter_context(cuda_names_on_cpu())  # CPU only: megatron's optimizer and verl's memory logs (fakes)
        if not mode.hook and device == "cpu":
            stack.enter_context(portable_legacy_kernel("torch"))
        if mode.hook and not mode.score_mask:
            original = step_scoring.response_score_rows
            step_scoring.response_score_rows = lambda batch, loss_function: None
            stack.callback(setattr, step_scoring, "response_score_rows", original)
        yield


def _engines(plan: Plan, mode: Mode, offload: bool):
    """(actor, reference) engines of one mode; the environment switch is read by verl's build step."""
    from verl_fused_hook.testing.train_engine import EngineSetup, build_engine

    os.environ[ENV_VAR] = "1" if mode.hook else "0"
    options = {"output_processor_backend": mode.backend} if mode.hook else {}
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

    from verl_fused_hook.testing.grpo_batches import packed

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
    from verl_fused_hook.testing.grpo_batches import packed, rollout

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
        output = actor.train_batch(data, loss_function=loss_function)
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
        from verl_fused_hook.testing.megatron_cpu import init_model_parallel

        init_model_parallel(plan.tp, seed=plan.seed)  # the engine then finds megatron's state set up


def _run_steps(plan: Plan, mode: Mode, offload: bool, first: int, save: bool, load: bool) -> list[dict]:
    from verl_fused_hook.testing.determinism import deterministic_steps
    from verl_fused_hook.testing.train_engine import load_checkpoint_for_resume

    with mode_context(mode, plan.device):
        actor, reference = _engines(plan, mode, offload)
        if load:
            load_checkpoint_for_resume(actor, plan.checkpoint_dir(mode.name))
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
                    actor.save_checkpoint(plan.checkpoint_dir(mode.name), global_step=step)
    _release(actor, reference)
    return rows


def _release(*engines) -> None:
    """Free one mode's engines before the next mode builds its own (megatron's parallel state stays)."""
    import gc

    for engine in engines:
        engine.module = engine.optimizer = engine.lr_scheduler = None
        engine.checkpoint_mananager = None  # sic: verl's spelling
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def uninterrupted_worker(rank: int, world_size: int, plan: Plan) -> dict:
    """Every mode, K steps from the start, for each offload setting (saving the checkpoint at K/2 in the first)."""
    _prepare_process(plan, rank)
    results = {}
    for name in plan.modes:
        mode = MODES[name]
        for offload in plan.offload:
            if offload and name not in plan.offload_modes:
                continue
            key = f"{name}/offload-{'on' if offload else 'off'}"
            started = time.time()
            # the checkpoint comes from the first offload setting, the one the resumed run uses
            results[key] = _run_steps(plan, mode, offload, first=1, save=offload == plan.offload[0], load=False)
            if rank == 0:
                print(f"[{key}] {plan.steps} steps in {time.time() - started:.1f}s", flush=True)
    return results


def resumed_worker(rank: int, world_size: int, plan: Plan) -> dict:
    """Every mode in a fresh process group: load the step-K/2 checkpoint, run steps K/2+1..K."""
    _prepare_process(plan, rank)
    results = {}
    for name in plan.modes:
        key = f"{name}/resumed"
        results[key] = _run_steps(plan, MODES[name], plan.offload[0], first=plan.checkpoint_step + 1, save=False, load=True)
        if rank == 0:
            print(f"[{key}] steps {plan.checkpoint_step + 1}-{plan.steps} done", flush=True)
    return results


def run_group(worker, plan: Plan) -> list[dict]:
    """`worker` in fresh processes: gloo on the CPU (one per TP rank), NCCL on one GPU."""
    if plan.device == "cpu":
        from verl_fused_hook.testing.distributed import run_on_gloo

        return run_on_gloo(worker, plan.tp, plan)
    return _run_on_one_gpu(worker, plan)


def _nccl_worker(rank, port, folder, worker, plan):
    import torch.distributed as dist

    from verl_fused_hook.testing.determinism import prepare_cublas_workspace

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    prepare_cublas_workspace()  # before the first GEMM: deterministic steps need it
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        torch.save(worker(0, 1, plan), os.path.join(folder, "rank0.pt"))
    finally:
        dist.destroy_process_group()


def _run_on_one_gpu(worker, plan: Plan) -> list[dict]:
    import torch.multiprocessing as mp

    from verl_fused_hook.testing.distributed import free_port

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_nccl_worker, args=(free_port(), folder, worker, plan), nprocs=1, start_method="spawn")
        return [torch.load(os.path.join(folder, "rank0.pt"), weights_only=False)]


# ---------------------------------------------------------------- comparison


def merge_ranks(per_rank: list[dict]) -> dict:
    """One row per step and run: rank 0's loss and grad norm; the checksum over all ranks' checksums."""
    merged = {}
    for key, rows in per_rank[0].items():
        merged[key] = []
        for index, row in enumerate(rows):
            ranks = [r[key][index] for r in per_rank]
            combined = hashlib.sha256("".join(r["param_checksum"] for r in ranks).encode()).hexdigest()
            merged[key].append(row | {"param_checksum": combined, "param_sum": sum(r["param_sum"] for r in ranks),
                                      "peak_bytes": max((r["peak_bytes"] or 0) for r in ranks) or None})
    return merged


IDENTITY_FIELDS = ("loss", "grad_norm", "param_checksum")


def identical(rows_a: list[dict], rows_b: list[dict]) -> tuple[bool, list[int]]:
    """Bitwise equality of loss, grad norm and checksum on the steps both runs have; the steps that differ."""
    by_step = {row["step"]: row for row in rows_a}
    differ = [row["step"] for row in rows_b if any(by_step[row["step"]][f] != row[f] for f in IDENTITY_FIELDS)]
    return not differ, differ


def largest_gap(reference: list[dict], other: list[dict]) -> dict:
    """Largest absolute loss gap and relative grad-norm gap to the reference over all steps, and both per step."""
    per_step = []
    for a, b in zip(reference, other):
        norm_gap = abs(a["grad_norm"] - b["grad_norm"]) / max(abs(a["grad_norm"]), 1e-12)
        per_step.append({"step": a["step"], "loss_abs": abs(a["loss"] - b["loss"]), "grad_norm_rel": norm_gap})
    return {
        "loss_abs": max(r["loss_abs"] for r in per_step),
        "grad_norm_rel": max(r["grad_norm_rel"] for r in per_step),
        "per_step": per_step,
    }


def one_kernel_mode(device: str) -> str:
    """The hook mode that computes with legacy's kernel: verl's Triton on CUDA, the portable op on the CPU."""
    return "hook-verl" if device == "cuda" else "hook-auto"


def evaluate(runs: dict, plan: Plan) -> dict:
    """The checks of the module docstring, with the gaps of the two-kernel modes."""
    checks, gaps = [], {}
    base = "offload-off"
    legacy = runs.get(f"legacy/{base}")
    same_kernel = one_kernel_mode(plan.device)
    for name in plan.modes:
        plain = runs[f"{name}/{base}"]
        if f"{name}/offload-on" in runs:
            ok, steps = identical(plain, runs[f"{name}/offload-on"])
            checks.append({"check": f"{name}: offload on == off", "ok": ok, "differing_steps": steps})
        ok, steps = identical(plain, runs[f"{name}/resumed"])
        checks.append({"check": f"{name}: resumed == uninterrupted (steps {plan.checkpoint_step + 1}-{plan.steps})",
                       "ok": ok, "differing_steps": steps})
        if legacy is None or name == "legacy":
            continue
        if name == same_kernel:
            ok, steps = identical(legacy, plain)
            checks.append({"check": f"{name} == legacy (one kernel)", "ok": ok, "differing_steps": steps})
        else:
            gap = largest_gap(legacy, plain)
            gaps[name] = gap
            bound = {"loss_abs": TWO_KERNEL_LOSS_ATOL[plan.dtype], "grad_norm_rel": TWO_KERNEL_GRAD_NORM_RTOL[plan.dtype]}
            exact, _ = identical(legacy, plain)
            ok = gap["loss_abs"] <= bound["loss_abs"] and gap["grad_norm_rel"] <= bound["grad_norm_rel"]
            checks.append({"check": f"{name} vs legacy: loss within {bound['loss_abs']:g} (absolute), grad norm "
                                    f"within {bound['grad_norm_rel']:g} (relative)", "ok": ok,
                           "largest": {k: gap[k] for k in bound}, "bitwise_identical": exact})
    return {"checks": checks, "gaps": gaps, "match": all(c["ok"] for c in checks)}


# ---------------------------------------------------------------- report


def summary_rows(runs: dict) -> list[dict]:
    """Per run: mean step time (steps after the first), peak memory, last loss."""
    rows = []
    for key, steps in runs.items():
        timed = [r["seconds"] for r in steps[1:]] or [steps[0]["seconds"]]
        peaks = [r["peak_bytes"] for r in steps if r["peak_bytes"]]
        rows.append({"run": key, "steps": len(steps), "mean_step_s": sum(timed) / len(timed),
                     "peak_gib": max(peaks) / 2**30 if peaks else None, "last_loss": steps[-1]["loss"]})
    return rows


def markdown(report: dict) -> str:
    lines = [f"# train-parity: {report['hf_config']} on {report['device']}, TP={report['tp']}, {report['dtype']}, "
             f"{report['steps']} steps", ""]
    lines += ["| run | steps | mean step (s) | peak memory (GiB) | last loss |", "|---|---|---|---|---|"]
    for row in report["summary"]:
        peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        lines.append(f"| {row['run']} | {row['steps']} | {row['mean_step_s']:.3f} | {peak} | {row['last_loss']:.6g} |")
    lines += ["", "| check | result |", "|---|---|"]
    for check in report["evaluation"]["checks"]:
        detail = "identical" if check["ok"] and "largest" not in check else ""
        if "largest" in check:
            detail = ", ".join(f"{k} {v:.2e}" for k, v in check["largest"].items())
        elif not check["ok"]:
            detail = f"differs at steps {check['differing_steps']}"
        lines.append(f"| {check['check']} | {'PASS' if check['ok'] else 'FAIL'}: {detail} |")
    gaps = report["evaluation"]["gaps"]
    if gaps:
        names = list(gaps)
        lines += ["", "| step | " + " | ".join(f"{n} loss gap (abs) | {n} grad-norm gap (rel)" for n in names) + " |",
                  "|---|" + "---|---|" * len(names)]
        for index, row in enumerate(gaps[names[0]]["per_step"]):
            cells = [f"{gaps[n]['per_step'][index]['loss_abs']:.2e} | {gaps[n]['per_step'][index]['grad_norm_rel']:.2e}"
                     for n in names]
            lines.append(f"| {row['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for key, steps in runs.items():
        if "offload-on" in key:
            continue
        style = "--" if key.endswith("resumed") else "-"
        x = [r["step"] for r in steps]
        axes[0].plot(x, [r["loss"] for r in steps], style, marker=".", label=key)
        axes[1].plot(x, [r["grad_norm"] for r in steps], style, marker=".", label=key)
    axes[0].set(xlabel="step", ylabel="loss (ppo_loss, summed over micro-batches)")
    axes[1].set(xlabel="step", ylabel="gradient norm")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ---------------------------------------------------------------- command line


def _pair(text: str, field: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{field}: expected LO,HI (two integers), got {text!r}") from None
    return low, high


def parse_plan(argv, checkpoint_root: str) -> tuple[Plan, Path]:
    from verl_fused_hook.testing.hf_model import TINY_QWEN2

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
    parser.add_argument("--nondeterministic", action="store_true", help="CUDA: PyTorch's default (faster, not "
                        "bitwise repeatable) algorithms; identities are then not expected to hold")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="train_parity", help="folder for train_parity.{json,md,png}")
    args = parser.parse_args(argv)

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
    )
    return plan, Path(args.out)


def main(argv=None) -> int:
    checkpoint_root = tempfile.mkdtemp(prefix="train_parity_ckpt_", dir=os.environ.get("TRAIN_PARITY_CHECKPOINT_DIR"))
    try:
        plan, out = parse_plan(argv, checkpoint_root)
        print(f"train-parity on {plan.device}, TP={plan.tp}, {plan.dtype}, {plan.steps} steps, modes "
              f"{', '.join(plan.modes)}; {plan.shape.prompts} prompts x {plan.shape.n} responses per step, "
              f"micro-batches of {plan.micro_batch}; model {plan.hf_path}", flush=True)
        runs = merge_ranks(run_group(uninterrupted_worker, plan))
        runs |= merge_ranks(run_group(resumed_worker, plan))
    finally:
        shutil.rmtree(checkpoint_root, ignore_errors=True)
    report = {
        "device": plan.device, "tp": plan.tp, "dtype": plan.dtype, "steps": plan.steps, "hf_config": plan.hf_path,
        "shape": asdict(plan.shape), "micro_batch": plan.micro_batch, "seed": plan.seed,
        "checkpoint_step": plan.checkpoint_step, "runs": runs, "summary": summary_rows(runs),
        "evaluation": evaluate(runs, plan),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_parity.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (out / "train_parity.md").write_text(table)
    plot(runs, out / "train_parity.png")
    print(table)
    print("PASS" if report["evaluation"]["match"] else "FAIL: see the checks above", flush=True)
    return 0 if report["evaluation"]["match"] else 1


if __name__ == "__main__":
    sys.exit(main())
