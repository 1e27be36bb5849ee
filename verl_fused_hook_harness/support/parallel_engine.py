"""One GRPO actor step through verl's real engine in every parallel layout verl's Megatron engine runs.

Why: pipeline (PP, virtual/interleaved VPP), expert (EP), context (CP) and tensor
(TP) parallelism change where hook mode's processor runs (the last stage only),
which rows it sees (CP halves, SP shards) and which micro-batch a stage holds.
A case builds verl's `MegatronEngineWithLMHead` through verl's own `__init__` /
`initialize()` (support/train_engine.py: only the model build is the local-spec
stand-in) for each side — verl's unfused path (fused kernels off), hook mode
with and without the score mask, hook mode with the fused loss — and runs
`train_batch` (verl's `forward_backward_batch` through megatron's schedule) on
packed GRPO micro-batches of different lengths, different on each DP rank.

The case's reference is the same model without the pipeline or expert split
(PP=1, EP=1, same TP and CP; layout-independent weights), fed the same data: a
stage handed the wrong hidden states changes verl's path and hook mode alike, and
only this comparison sees it. verl, megatron-core and the runtime load in the
worker processes only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from verl_fused_hook.switch import ENV_VAR
from verl_fused_hook.verl_integration.distillation import TOPK_OUTPUT_KEYS

from .distillation import PRESETS, add_teacher, distillation_config, step_flags
from .distillation import loss_function as distillation_loss_function
from .grpo_batches import RolloutShape, packed, rollout
from .hf_model import CONFIGS, TINY_QWEN2, config_folder

TINY_QWEN3_MOE = CONFIGS / "tiny_qwen3_moe"
SEED = 1234
TEMPERATURE = 0.9
SHAPE = RolloutShape(prompts=2, n=4, prompt_lengths=(3, 9), response_lengths=(2, 10))
MICRO_BATCH = 2  # 8 sequences a rank: 4 micro-batches of 2 packed sequences each
# MoE with the load-balancing aux loss on (mbridge's Qwen3-MoE conversion turns it off, verl's RL default);
# train_engine adds what the local spec needs for MoE.
MOE_OVERRIDES = {"moe_router_load_balancing_type": "aux_loss", "moe_aux_loss_coeff": 0.01}

# The fused loss in chunks of a few rows (~10 KiB of logits): every micro-batch runs several chunks, and ranks
# with different numbers of scored rows (pipeline stages, CP halves) run different numbers of them.
FUSED_LOSS_CHUNK_GIB = 1e-5
UNFUSED, HOOK, HOOK_NO_MASK, HOOK_FUSED_LOSS = "unfused", "hook", "hook-no-mask", "hook-fused-loss"
LEGACY = "legacy"  # verl's legacy fused forward (VERL_FUSED_USE_OP_HOOK=0; on the CPU with the portable kernel)
SIDES = (UNFUSED, HOOK, HOOK_NO_MASK, HOOK_FUSED_LOSS)
REFERENCE = "reference"  # verl's unfused path on the case's reference layout
# The per-token model outputs a side's result holds on the response rows (those the step's loss read)
MODEL_OUTPUT_KEYS = ("log_probs", "entropy", *TOPK_OUTPUT_KEYS)


@dataclass(frozen=True)
class ParallelCase:
    """A parallel layout and model: `world` gloo processes; what is left over after TP x CP x PP is DP."""

    name: str
    world: int
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    layers: int | None = 2  # None: the config's own
    experts: int = 0  # MoE: the number of experts (top-2; the tiny Qwen3-MoE config unless hf_path), 0: dense
    mtp: bool = False
    padded: bool = False  # verl's padded (BSHD) layout: use_remove_padding=False
    tied: bool | None = None  # tie_word_embeddings (None: the config's); tied, the last stage's output layer
    # shares the first stage's embedding
    loss_agg_mode: str = "token-mean"
    loss_mode: str = "vanilla"  # verl's policy_loss.loss_mode
    backend: str = "auto"  # the hook sides' output_processor_backend
    hf_path: str | None = None  # the model's HF config (default: the tiny Qwen2, or the tiny Qwen3-MoE with experts)
    overrides: tuple = ()  # more transformer config overrides, as (key, value) pairs
    # verl's distillation_ppo_loss instead of ppo_loss: a setup of support/distillation.PRESETS, the teacher's
    # top-k in the batch and the trainer's distillation flags
    distillation: str | None = None

    def __post_init__(self):
        if self.world % (self.tp * self.cp * self.pp) or (self.world // self.pp) % (self.ep * self.tp):
            raise ValueError(f"ParallelCase {self.name}: world {self.world} does not fit tp x cp x pp x ep")

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    def reference(self) -> ParallelCase:
        """The same model and data without the pipeline and expert split (same TP, CP and world)."""
        return replace(self, name=f"{self.name}/reference", pp=1, vpp=None, ep=1)

    def data_index(self, rank: int) -> int:
        """This rank's DP rank in this case's layout (megatron's order: TP fastest, then CP, then DP, then PP):
        the reference's ranks take the data the case's rank of the same number takes."""
        return (rank // (self.tp * self.cp)) % self.dp


def hf_config_folder(case: ParallelCase) -> str:
    """A Hugging Face config folder for the case's model: its config (default the tiny Qwen2, or the tiny
    Qwen3-MoE with experts) with the case's layers, experts and tied embeddings (written once per content to the
    temporary folder)."""
    base = Path(config_folder(case.hf_path or (TINY_QWEN3_MOE if case.moe else TINY_QWEN2)))
    config = json.loads((base / "config.json").read_text())
    if case.layers is not None:
        config["num_hidden_layers"] = case.layers
    if case.experts:
        config["num_experts"], config["num_experts_per_tok"] = case.experts, min(2, case.experts)
    if case.tied is not None:
        config["tie_word_embeddings"] = case.tied
    if case.mtp:
        config["num_nextn_predict_layers"] = 1  # what verl reads to see MTP layers
    text = json.dumps(config, sort_keys=True)
    folder = Path(tempfile.gettempdir()) / f"verl_fused_hook_cfg_{zlib.crc32(text.encode()):08x}"
    folder.mkdir(exist_ok=True)
    if not (folder / "config.json").exists():  # every process of a launch may get here at once: write, then rename
        partial = folder / f"config.json.{os.getpid()}"
        partial.write_text(text)
        os.replace(partial, folder / "config.json")
    return str(folder)


def side_options(side: str, backend: str = "auto") -> dict:
    """(environment switch, use_fused_kernels, fused_kernel_options) of one side."""
    if side == UNFUSED:
        return dict(switch=None, fused=False, options={})
    if side == LEGACY:
        return dict(switch="0", fused=True, options={})
    options = {"output_processor_backend": backend}
    if side == HOOK_NO_MASK:
        options["output_processor_score_mask"] = False
    if side == HOOK_FUSED_LOSS:
        options["output_processor_fused_loss"] = True
        options["output_processor_fused_loss_chunk_gib"] = FUSED_LOSS_CHUNK_GIB
    return dict(switch="1", fused=True, options=options)


def init_layout(case: ParallelCase) -> None:
    """megatron's parallel state for the case, and its MoE metrics tracker fresh (sized by the first model that
    logs to it), as in a new process."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker

    from ..stand_ins.megatron_cpu import init_model_parallel

    init_model_parallel(case.tp, seed=SEED, cp_size=case.cp, pp_size=case.pp, vpp_size=case.vpp, ep_size=case.ep)
    destroy_moe_metrics_tracker()


def build_side_engine(case: ParallelCase, side: str):
    """verl's engine for one side of a case (megatron's parallel state must hold the case's layout)."""
    from .train_engine import EngineSetup, build_engine

    choice = side_options(side, case.backend)
    os.environ.pop(ENV_VAR, None)
    if choice["switch"] is not None:
        os.environ[ENV_VAR] = choice["switch"]
    overrides = dict(case.overrides)
    if case.moe:
        overrides = {**MOE_OVERRIDES, **overrides}
    if case.mtp:
        overrides = {"mtp_num_layers": 1, **overrides}
    setup = EngineSetup(
        hf_path=hf_config_folder(case), tp=case.tp, dtype="float32", seed=SEED, micro_batch_size=MICRO_BATCH,
        total_steps=4, lr=1e-4, offload=False, fused_kernel_options=choice["options"], pp=case.pp, vpp=case.vpp,
        cp=case.cp, ep=case.ep, use_fused_kernels=choice["fused"], use_remove_padding=not case.padded,
        transformer_overrides=overrides, mtp=case.mtp, distributed_optimizer=False, layout_independent_weights=True,
    )  # fmt: skip
    return build_engine(setup)


def step_batch(case: ParallelCase, index: int, vocab_size: int, dp_size: int, fused_kernels: bool):
    """The GRPO batch of data index `index` (verl's packed layout, old and reference log-probs near typical
    values, with distillation the teacher's top-k and the trainer's flags); global_batch_size counts every DP
    rank's sequences."""
    fields = rollout(SHAPE, vocab_size, SEED + index, step=1)
    generator = torch.Generator().manual_seed(SEED + 100 + index)
    for key in ("old_log_probs", "ref_log_prob"):
        fields[key] = -6.9 + 0.3 * torch.randn(fields["responses"].shape, generator=generator)
    flags = {}
    if case.distillation is not None:
        config = distillation_config(**PRESETS[case.distillation])
        add_teacher(fields, config, vocab_size, SEED + index)
        flags = step_flags(config)
    return packed(
        fields, TEMPERATURE, calculate_entropy=True, global_batch_size=SHAPE.sequences * dp_size,
        use_remove_padding=not case.padded, use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO_BATCH,
        use_fused_kernels=fused_kernels, **flags,
    )  # fmt: skip


def case_loss_function(case: ParallelCase):
    """verl's ppo_loss as a GRPO run configures it (clipped PG, entropy bonus, low-var KL), or with `distillation`
    verl's distillation_ppo_loss around it, as verl's worker binds it."""
    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    config = McoreActorConfig(
        ppo_mini_batch_size=SHAPE.prompts, ppo_micro_batch_size_per_gpu=MICRO_BATCH, use_dynamic_bsz=False,
        entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl",
        loss_agg_mode=case.loss_agg_mode, rollout_n=SHAPE.n,
    )  # fmt: skip
    config = replace(config, policy_loss=replace(config.policy_loss, loss_mode=case.loss_mode))
    if case.distillation is not None:
        return distillation_loss_function(config, distillation_config(**PRESETS[case.distillation]))
    return functools.partial(ppo_loss, config=config)


def _plain(value):
    """A metric as plain numbers: verl's Metric objects by their aggregate, tensors as floats."""
    if hasattr(value, "aggregate"):
        return float(value.aggregate())
    if isinstance(value, torch.Tensor):
        return value.detach().double().cpu().tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def gradients(engine) -> dict[str, torch.Tensor]:
    """Every parameter's gradient on this rank (DDP's main_grad, after the backward and its DP reduction), by its
    global name."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from .layout_weights import global_name

    config, tied = engine.tf_config, engine.share_embeddings_and_output_weights
    local_experts = (config.num_moe_experts or 0) // parallel_state.get_expert_model_parallel_world_size()
    expert_offset = parallel_state.get_expert_model_parallel_rank() * local_experts
    grads = {}
    for chunk_index, chunk in enumerate(engine.module):
        offset = get_transformer_layer_offset(config, chunk_index if len(engine.module) > 1 else None)
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None:
                grads[global_name(name.replace("module.", ""), offset, expert_offset, tied)] = (
                    grad.detach().cpu().clone()
                )
    return grads


LAYOUT_FIELDS = (
    "tensor_model_parallel_size", "sequence_parallel", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "num_moe_experts", "moe_router_topk", "moe_router_load_balancing_type",
    "moe_aux_loss_coeff", "mtp_num_layers", "overlap_p2p_comm", "batch_p2p_comm", "variable_seq_lengths",
)  # fmt: skip


def engine_layout(engine) -> dict:
    """What verl's engine actually built: its transformer config's parallel and MoE/MTP fields, the model chunks
    on this rank, and whether fused kernels stayed on."""
    layout = {name: getattr(engine.tf_config, name, None) for name in LAYOUT_FIELDS}
    return {**layout, "model_chunks": len(engine.module), "use_fused_kernels": engine.engine_config.use_fused_kernels}


def repeatable_on_cuda(case: ParallelCase, engine):
    """Dense models on CUDA: bitwise-repeatable steps (support/determinism.py), so that two sides computing with
    one kernel compare exactly. MoE models not: megatron's token unpermutation adds with atomics on CUDA."""
    if not torch.cuda.is_available() or case.moe:
        return contextlib.nullcontext()
    from .determinism import deterministic_steps

    return deterministic_steps(*engine.module)


def train_batch(engine, data, loss_function) -> tuple[dict, dict[str, torch.Tensor]]:
    """verl's `BaseEngine.train_batch`, line for line, with the gradients read between the backward and the
    optimizer step (megatron's optimizer step leaves DDP's gradient buffers zeroed)."""
    from verl.utils.tensordict_utils import maybe_fix_3d_position_ids

    maybe_fix_3d_position_ids(data)
    engine.optimizer_zero_grad()
    outputs = engine.forward_backward_batch(data, loss_function, forward_only=False)
    grads = gradients(engine)
    grad_norm = engine.optimizer_step()
    if engine.is_mp_src_rank_with_outputs():
        outputs["metrics"]["grad_norm"] = grad_norm
    return outputs, grads


def run_side(
    case: ParallelCase, side: str, data_index: int, fault: Callable | None = None, observer: Callable | None = None
) -> dict:
    """One train_batch of one side on the batch `data_index`: per micro-batch loss, verl's metrics, the response
    log-probs and entropy (last stage), every gradient, how many micro-batches ran ppo_loss inside the op, and
    what `observer` reported (under "observed")."""
    from verl.workers.utils.padding import no_padding_2_padding

    from ..stand_ins.legacy_kernel_swap import portable_legacy_kernel_on_cpu
    from .train_engine import fused_loss_forwards, release_engines

    device = "cuda" if torch.cuda.is_available() else "cpu"
    legacy_kernel = portable_legacy_kernel_on_cpu(device) if side == LEGACY else contextlib.nullcontext()
    with legacy_kernel:  # verl's Triton kernel needs CUDA: on the CPU legacy computes with the portable op
        engine = build_side_engine(case, side)
        if fault is not None:
            fault(engine)
        report = observer(engine) if observer is not None else None
        data = step_batch(case, data_index, engine.model_config.hf_config.vocab_size, engine.get_data_parallel_size(),
                          side_options(side)["fused"])  # fmt: skip
        with engine.train_mode(), repeatable_on_cuda(case, engine):
            output, grads = train_batch(engine, data, case_loss_function(case))
    result = {
        "losses": [float(loss) for loss in output.get("loss", [])],
        "metrics": {key: _plain(value) for key, value in output.get("metrics", {}).items()},
        "grads": grads,
        "fused_loss_calls": fused_loss_forwards(engine),
        "layout": engine_layout(engine),
    }
    if report is not None:
        result["observed"] = report()
    model_output = output.get("model_output", {})
    for key in MODEL_OUTPUT_KEYS:
        if key in model_output:
            result[key] = no_padding_2_padding(model_output[key].detach().cpu(), data).float()
    release_engines(engine)
    return result


@dataclass(frozen=True)
class CaseRun:
    """One case in a launch: which sides run, an optional test-only fault: a function given each engine of
    `fault_sides` after its build, and an optional observer: a function given every side's engine after its build
    that changes nothing and returns a callable whose value after the step is the result's "observed" (both
    module-level, so the worker processes can import them)."""

    case: ParallelCase
    sides: tuple[str, ...] = SIDES
    fault: Callable | None = None
    fault_sides: tuple[str, ...] = ()
    observer: Callable | None = None


def parallel_worker(rank: int, world_size: int, runs: list[CaseRun]) -> dict:
    """Every case of `runs` on this rank: {case name: {side: result}}, plus the case's reference when the case
    splits the model (PP or EP; computed once per reference layout and data mapping)."""
    from ..stand_ins.cuda_on_cpu import cuda_names_on_cpu
    from .verl_engine import prepare_verl_process

    prepare_verl_process(rank)
    results, references = {}, {}
    with cuda_names_on_cpu():
        for run in runs:
            case = run.case
            index = case.data_index(rank)
            init_layout(case)
            results[case.name] = {
                side: run_side(case, side, index, run.fault if side in run.fault_sides else None, run.observer)
                for side in run.sides
            }
            if case.pp > 1 or case.ep > 1:  # else the unfused side is already unsplit
                layout = {k: v for k, v in asdict(case.reference()).items() if k != "name"}
                # the same on every rank (a reference is a collective run): the layout and the case's data mapping
                key = json.dumps({**layout, "case_dp": case.dp}, sort_keys=True, default=str)
                if key not in references:
                    init_layout(case.reference())
                    references[key] = run_side(case.reference(), UNFUSED, index)
                results[case.name][REFERENCE] = references[key]
    os.environ.pop(ENV_VAR, None)
    return results


def run_launch(runs: list[CaseRun], *, device: str = "cpu") -> list[dict]:
    """The cases in one set of processes (gloo on the CPU, NCCL with one GPU a rank; one world size for all:
    process start-ups cost most); every rank's results."""
    from .distributed import backend_for, run_in_processes

    worlds = {run.case.world for run in runs}
    if len(worlds) != 1:
        raise ValueError(f"one launch runs one world size, got {sorted(worlds)}")
    return run_in_processes(parallel_worker, worlds.pop(), runs, backend=backend_for(device))
