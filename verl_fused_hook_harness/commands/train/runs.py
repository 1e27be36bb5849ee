"""train-parity's runs: the engines of one mode, one GRPO step through them, a run of K steps (with its checkpoint
or resume) and the worker processes that run every mode and add each finished run to the report.

The plan (`Plan`) is what every process of a call holds; the command line (train_parity.py) builds it. Each
run builds verl's engines as verl does (support/train_engine.py) with the mode's `fused_kernel_options`; the
environment switch picks legacy or hook at verl's build step. verl, megatron-core and the runtime's
megatron-dependent parts load in the worker processes only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from verl_fused_hook.switch import ENV_VAR

from ...stand_ins.cuda_on_cpu import cuda_names_on_cpu
from ...stand_ins.legacy_kernel_swap import portable_legacy_kernel_on_cpu
from ...support.determinism import deterministic_steps
from ...support.distributed import backend_for, run_in_processes
from ...support.grpo_batches import RolloutShape, packed, rollout
from ...support.layer_spec import LOCAL, MBRIDGE, batch_invariant_kernels, spec_overrides
from ...support.train_engine import (
    EngineSetup,
    build_engine,
    fused_loss_forwards,
    load_checkpoint_for_resume,
    release_engines,
)
from ...support.verl_engine import prepare_verl_process
from . import report as report_file
from .modes import MODES, Mode, fused_kernel_options

TEMPERATURE = 1.0
ENTROPY_COEF = 0.01
KL_COEF = 0.001
LR = 1e-4


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
    deterministic: bool  # CUDA: bitwise-repeatable steps (support/determinism.py)
    checkpoint_root: str
    out: str  # the report's folder: every finished run is added to it at once
    resume: bool = True  # run the resumed half (fresh processes, the checkpoint of the first offload setting)
    pp: int = 1  # pipeline-parallel size (CPU: gloo processes)
    ep: int = 1  # expert-parallel size (an MoE config; data-parallel ranks = EP, each holding the same batch)
    layer_spec: str = LOCAL  # the resolved spec: TE builds through verl's own build (train_engine.py)
    bridge: str = MBRIDGE  # verl's builder (layer_spec TE for Megatron-Bridge)
    batch_invariant: bool = False  # megatron's batch_invariant_mode (TE with FlashAttention 3/4 only)
    # the old log-probs' micro-batch (verl's log_prob_micro_batch_size_per_gpu), None: micro_batch's packing
    old_log_prob_micro_batch: int | None = None

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.ep

    @property
    def checkpoint_step(self) -> int:
        return self.steps // 2

    def checkpoint_dir(self, mode: str) -> str:
        return os.path.join(self.checkpoint_root, mode)

    def configuration(self) -> dict:
        """What must agree between two reports for their runs to be compared (report.py)."""
        layout = {name: size for name, size in (("pp", self.pp), ("ep", self.ep)) if size > 1}  # earlier reports: 1
        # earlier reports: the local spec, batch invariance off
        spec = {"layer_spec": self.layer_spec} if self.layer_spec != LOCAL else {}
        spec |= {"batch_invariant": True} if self.batch_invariant else {}
        spec |= {"bridge": self.bridge} if self.bridge != MBRIDGE else {}  # earlier reports: mbridge
        if self.old_log_prob_micro_batch is not None:  # earlier reports: the update's packing
            spec["old_log_prob_micro_batch"] = self.old_log_prob_micro_batch
        return {
            "device": self.device, "tp": self.tp, **layout, **spec, "dtype": self.dtype, "steps": self.steps,
            "hf_config": config_identity(Path(self.hf_path)),
            "shape": asdict(self.shape), "micro_batch": self.micro_batch, "seed": self.seed,
            "checkpoint_step": self.checkpoint_step, "deterministic": self.deterministic,
        }  # fmt: skip


def config_identity(hf_path: Path) -> str:
    """The model config's name and a hash of its contents: the same model wherever the repository sits."""
    file = hf_path / "config.json" if hf_path.is_dir() else hf_path
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:12]
    return f"{file.parent.name} (config.json sha256 {digest})"


# ---------------------------------------------------------------- one mode's engines


@contextlib.contextmanager
def mode_context(mode: Mode, device: str, batch_invariant: bool = False):
    """The kernel legacy computes with (portable op on the CPU), on the CPU the fakes that let megatron's
    optimizer run there (stand_ins/cuda_on_cpu.py), and megatron's batch-invariant kernels where asked.
    hook-auto (no mask) is what hook mode does for a loss that may read every row: its engines are built with
    `output_processor_score_mask=false`."""
    with (
        cuda_names_on_cpu(),
        contextlib.nullcontext() if mode.hook else portable_legacy_kernel_on_cpu(device),
        batch_invariant_kernels(batch_invariant),
    ):
        yield


def build_engines(plan: Plan, mode: Mode, offload: bool):
    """(actor, reference) engines of one mode; the environment switch is read by verl's build step."""
    os.environ[ENV_VAR] = "1" if mode.hook else "0"
    options = fused_kernel_options(mode, batch_invariant=plan.batch_invariant)
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
        pp=plan.pp,
        ep=plan.ep,
        layer_spec=plan.layer_spec,
        bridge=plan.bridge,
        transformer_overrides=spec_overrides(batch_invariant=plan.batch_invariant) or None,
    )
    actor = build_engine(setup)
    reference = build_engine(replace(setup, offload=False), forward_only=True)
    return actor, reference


def ppo_loss_function(plan: Plan):
    """verl's ppo_loss with the actor config a GRPO run uses (clipped PG, entropy bonus, low-var KL)."""
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


def engine_keys(plan: Plan, micro_batch: int | None = None) -> dict:
    """The non-tensor entries verl's TrainingWorker adds to every batch (micro-batches of `micro_batch`
    sequences, by default the update's)."""
    return dict(
        use_remove_padding=True,
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=micro_batch or plan.micro_batch,
        use_fused_kernels=True,
    )


def forward_only_log_probs(engine, fields, plan: Plan, *, entropy: bool, micro_batch: int | None = None):
    """Forward-only log-probs as the trainer computes old/reference log-probs, padded [batch, response]; under
    PP only the last stage computes them, and every stage gets them (verl's driver hands the next call's batch
    to every rank)."""
    from megatron.core import parallel_state
    from verl.workers.utils.padding import no_padding_2_padding

    keys = engine_keys(plan, micro_batch)
    data = packed(fields, TEMPERATURE, calculate_entropy=entropy, compute_loss=False, **keys)
    with engine.eval_mode():
        output = engine.infer_batch(data, loss_function=None)
    if plan.pp == 1:
        return no_padding_2_padding(output["model_output"]["log_probs"], data).float().cpu()
    group = parallel_state.get_pipeline_model_parallel_group()
    values = torch.zeros(fields["responses"].shape, dtype=torch.float32)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        values = no_padding_2_padding(output["model_output"]["log_probs"], data).float().cpu()
    values = values.to(plan.device)
    dist.broadcast(values, dist.get_global_rank(group, group.size() - 1), group=group)
    return values.cpu()


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
    device = plan.device
    allocated = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()
    started = time.perf_counter()
    fields = rollout(plan.shape, actor.model_config.hf_config.vocab_size, plan.seed, step)
    fields["old_log_probs"] = forward_only_log_probs(
        actor, fields, plan, entropy=True, micro_batch=plan.old_log_prob_micro_batch
    )
    packing_difference, probe_seconds = None, 0.0
    if plan.old_log_prob_micro_batch is not None:  # the same sequences in the update's packing, same weights
        probe_started = time.perf_counter()  # the forward above returned on the host: nothing of it is pending
        in_update_packing = forward_only_log_probs(actor, fields, plan, entropy=True)
        packing_difference = float((in_update_packing - fields["old_log_probs"]).abs().max())
        probe_seconds = time.perf_counter() - probe_started
    fields["ref_log_prob"] = forward_only_log_probs(reference, fields, plan, entropy=False)
    data = packed(
        fields, TEMPERATURE, calculate_entropy=True, global_batch_size=plan.shape.sequences, **engine_keys(plan)
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
    seconds = time.perf_counter() - started - checksum_seconds - probe_seconds  # the step, not our checks
    losses = output.get("loss")  # none on the stages before the last
    metrics = output.get("metrics", {})
    grad_norm = metrics.get("grad_norm")
    return {
        "step": step,
        "loss": None if losses is None else float(sum(losses) if isinstance(losses, list) else losses),
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "param_checksum": checksum,
        "param_sum": total,
        "old_log_prob_sum": float(fields["old_log_probs"].double().sum()),
        # with old log-probs in another packing: the largest difference of a token's log-prob between the two
        "packing_max_abs": packing_difference,
        # every micro-batch's PPO KL and clip fraction: 0 when the update recomputes the old log-probs exactly
        "ppo_kl": metric_values(metrics.get("actor/ppo_kl")),
        "pg_clipfrac": metric_values(metrics.get("actor/pg_clipfrac")),
        "fused_loss_calls": update_fused_loss_calls,  # micro-batches whose ppo_loss ran inside the op
        "seconds": seconds,
        "peak_bytes": int(torch.cuda.max_memory_allocated()) if device == "cuda" else None,
        "allocated_bytes_at_start": allocated,  # weights, grads and optimizer state held between steps
    }


def metric_values(metric) -> list[float] | None:
    """Every micro-batch's value of one of verl's metrics (a Metric, or a list of them or of numbers); None
    where the rank has none (the stages before the last)."""
    if metric is None:
        return None
    items = metric if isinstance(metric, list) else [metric]
    return [float(value) for item in items for value in (item.values if hasattr(item, "values") else [item])]


# ---------------------------------------------------------------- one process group


def prepare_process(plan: Plan, rank: int) -> None:
    prepare_verl_process(rank)
    if plan.device == "cpu":
        from ...stand_ins.megatron_cpu import init_model_parallel

        init_model_parallel(plan.tp, seed=plan.seed, pp_size=plan.pp, ep_size=plan.ep)  # the engine finds it set up


def run_steps(plan: Plan, mode: Mode, offload: bool, first: int, save: bool, load: bool) -> tuple[list[dict], dict]:
    """One run's step rows and where its wall time went (engine builds, checkpoint save or load)."""
    started = time.perf_counter()
    info = {"build_s": None, "save_s": None, "load_s": None}
    with mode_context(mode, plan.device, plan.batch_invariant):
        actor, reference = build_engines(plan, mode, offload)
        info["build_s"] = time.perf_counter() - started
        if load:
            loading = time.perf_counter()
            load_checkpoint_for_resume(actor, plan.checkpoint_dir(mode.name))
            info["load_s"] = time.perf_counter() - loading
        loss_function = ppo_loss_function(plan)
        repeatable = (
            deterministic_steps(*actor.module, *reference.module, te_attention=True)
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
    release_engines(actor, reference)
    info["wall_s"] = time.perf_counter() - started
    return rows, info


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


def record(plan: Plan, rank: int, world_size: int, key: str, rows: list[dict], info: dict) -> None:
    """Add a finished run (every rank's checksums combined) to the report on disk and say so."""
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
    prepare_process(plan, rank)
    for name in plan.modes:
        for offload in plan.offload:
            if offload and name not in plan.offload_modes:
                continue
            key = f"{name}/offload-{'on' if offload else 'off'}"
            # the checkpoint comes from the first offload setting, the one the resumed run uses
            save = plan.resume and offload == plan.offload[0]
            rows, info = run_steps(plan, MODES[name], offload, first=1, save=save, load=False)
            record(plan, rank, world_size, key, rows, info)


def resumed_worker(rank: int, world_size: int, plan: Plan) -> None:
    """Every mode in a fresh process group: load the step-K/2 checkpoint, run steps K/2+1..K."""
    prepare_process(plan, rank)
    origin = f"offload-{'on' if plan.offload[0] else 'off'}"
    for name in plan.modes:
        rows, info = run_steps(
            plan, MODES[name], plan.offload[0], first=plan.checkpoint_step + 1, save=False, load=True
        )
        record(plan, rank, world_size, f"{name}/resumed", rows, info | {"resumes": f"{name}/{origin}"})


def run_group(worker, plan: Plan) -> None:
    """`worker` in fresh processes (gloo on the CPU, one per TP x PP x EP rank; NCCL on one GPU); it records its
    own runs."""
    run_in_processes(worker, plan.world, plan, backend=backend_for(plan.device))
