"""What every `e2e-bench` flavour (THD/BSHD modes, `--mtp`, `--fused-loss`) shares: the one process and its
device, the model from the HF config, the report's header fields, and the clock that times a step and its peak.

Why: each flavour runs one process on one device at TP=1, builds a GPTModel from `--hf-config` and times
forward+backward steps the same way (CUDA events and `max_memory_allocated` on GPUs; wall time and the tensors'
peak bytes on the CPU, where timings mean nothing), so their tables read alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...support.determinism import prepare_cublas_workspace
from ...support.distributed import init_single_process
from ...support.hf_model import build_gpt_from_hf, load_hf_config
from ...support.layer_spec import spec_overrides
from ...support.memory import PeakMemory
from ...support.micro_batches import TEMPERATURE
from ...support.reports import device_name
from ...support.verl_engine import prepare_verl_process

# megatron's full activation recompute as verl's users set it (override_transformer_config): every layer's
# activations are recomputed in backward, one layer per checkpoint.
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def prepare_process(args, *, deterministic_parity: bool = True):
    """This process ready to drive verl's engine (plugin installed, verl's engine imported), as a one-rank
    group with megatron's parallel state; returns the HF config from `args.hf_config`. With
    `deterministic_parity` the parity steps can run bitwise repeatable on CUDA."""
    prepare_verl_process()
    if args.device == "cuda" and deterministic_parity:
        prepare_cublas_workspace()  # before the first GEMM: the parity steps run deterministic
    init_single_process(args.device, args.seed)
    hf_config = load_hf_config(args.hf_config)
    if args.layers is not None:
        hf_config.num_hidden_layers = args.layers  # mbridge's conversion reads the layer count from here
    return hf_config


def build_model(args, hf_config, *, announce: bool = True, layer_spec: str | None = None, **extra):
    """The GPTModel of `hf_config` on `args.device` (dtype, seed and initialization from `args`; megatron's full
    activation recompute with `args.recompute`), on `layer_spec` (default the run's first, `args.layer_specs[0]`);
    with `args.grad_accum_fusion` wrapped in megatron's DDP (`wrap_for_main_grad`)."""
    started = time.time()
    layer_spec = layer_spec or args.layer_specs[0]
    overrides = {
        **(FULL_RECOMPUTE if args.recompute else {}),
        **spec_overrides(batch_invariant=args.batch_invariant, grad_accum_fusion=args.grad_accum_fusion),
    }
    model = build_gpt_from_hf(
        hf_config,
        dtype=args.dtype,
        seed=args.seed,
        cpu_initialization=args.cpu_init,
        transformer_overrides=overrides or None,
        layer_spec=layer_spec,
        **extra,
    ).to(args.device)
    if args.grad_accum_fusion:
        model = wrap_for_main_grad(model)
    if announce:
        recompute = ", full recompute" if args.recompute else ""
        print(
            f"model built in {time.time() - started:.1f}s: {sum(p.numel() for p in model.parameters()) / 1e9:.3f}B "
            f"parameters, {args.dtype}, {model.config.num_layers} layers{recompute}, hidden {hf_config.hidden_size}, "
            f"vocab {hf_config.vocab_size}, {layer_spec} layer spec ({args.layer_spec_reasons[layer_spec]})",
            flush=True,
        )
    return model


def wrap_for_main_grad(model):
    """`model` in megatron's DDP as verl's actor is (fp32 `main_grad` buffers, distributed optimizer's layout): where
    gradient_accumulation_fusion puts the weight gradients (TE's layers, megatron's output layer and the op's)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def model_fields(model) -> dict:
    """What the report says of the built model: its layer count and recompute settings (its config's fields)."""
    config = model.config
    return {"num_layers": config.num_layers, **{key: getattr(config, key) for key in FULL_RECOMPUTE}}


def report_header(args, model=None, **fields) -> dict:
    """The fields every e2e report starts with (the built model's fields where given); `fields` go after the
    model's and before the run's settings."""
    return {
        "device": device_name(args.device),
        "torch": torch.__version__,
        "hf_config": str(args.hf_config),
        **({} if model is None else {"model": model_fields(model)}),
        "layer_specs": list(args.layer_specs),
        "layer_spec_reasons": dict(args.layer_spec_reasons),
        **{option: True for option in ("grad_accum_fusion", "batch_invariant") if getattr(args, option)},
        **fields,
        "warmups": args.warmups,
        "repeats": args.repeats,
    }


def header_with_temperature(args, model, **fields) -> dict:
    """`report_header` for the flavours that report their dtype and temperature first."""
    return report_header(args, model, dtype=str(args.dtype), temperature=TEMPERATURE, **fields)


class Clock:
    """Times and peaks of repeated steps; `last_times` keeps the last measurement's every repeat (the noise)."""

    def __init__(self, device: str):
        self.device = device
        self.last_times: list[float] = []

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
                started = time.perf_counter()
                tracker = PeakMemory()
                with tracker:
                    fn()
                times.append(time.perf_counter() - started)
                peaks.append(tracker.peak)
        self.last_times = times
        return statistics.median(times), max(peaks), max(absolute)


@dataclass
class Primed:
    """A mode ready to be timed (its parity sample and warm-ups done): its step, its report row, how to put the
    model in its mode, and what each kind of timed work is for it (e.g. "train": its forward+backward)."""

    step: Any
    row: dict
    switch: Callable[[], object]
    works: dict[str, Callable[[], object]] = field(default_factory=dict)


def time_in_rounds(
    primed: list[Primed],
    clock: Clock,
    repeats: int,
    prepare: dict[str, Callable | None],
    on_oom,
    tally: tuple[str, Callable[[], int]] | None = None,
) -> None:
    """Every kind of work in `prepare` (kind -> what runs untimed before each repeat, or None), its timed repeats in
    rounds over the modes (A, B, C, A, B, C, ...), into each row as KIND_s (median), KIND_times_s, KIND_peak_bytes
    and KIND_peak_abs_bytes. A drift of the host's or the GPU's speed during the run then spreads over every mode
    instead of favouring the one timed first. A mode out of device memory gets `on_oom(primed)` and leaves the
    rounds. `tally` (key, counter): each row's KEY gains what the counter added during its own timed steps."""
    for kind, before in prepare.items():
        times = {id(p): [] for p in primed}
        peaks = {id(p): [0] for p in primed}
        absolute = {id(p): [0] for p in primed}
        for _ in range(repeats):
            for p in primed:
                if p.row.get("oom"):
                    continue
                p.switch()
                counted = tally[1]() if tally else 0
                try:
                    seconds, peak, peak_absolute = clock.measure(p.works[kind], 1, before)
                except torch.OutOfMemoryError:
                    on_oom(p)
                    continue
                if tally:
                    p.row[tally[0]] = p.row.get(tally[0], 0) + tally[1]() - counted
                times[id(p)].append(seconds)
                peaks[id(p)].append(peak)
                absolute[id(p)].append(peak_absolute)
        for p in primed:
            if not p.row.get("oom"):
                p.row[f"{kind}_s"], p.row[f"{kind}_times_s"] = statistics.median(times[id(p)]), times[id(p)]
                p.row[f"{kind}_peak_bytes"], p.row[f"{kind}_peak_abs_bytes"] = max(peaks[id(p)]), max(absolute[id(p)])


def mark_out_of_memory(model, tokens: int, row: dict, width: int = 15) -> None:
    """A mode that ran out of device memory: marked in its row (the table says OOM), its memory freed, a line."""
    row["oom"] = True
    free_step_memory(model)
    print(f"[{tokens}] {row['mode']:<{width}} out of device memory", flush=True)


def spread(times: list[float] | None) -> str:
    """' ±x%': half the range of the repeats over their median ('' with fewer than two)."""
    if not times or len(times) < 2:
        return ""
    return f" ±{50 * (max(times) - min(times)) / statistics.median(times):.0f}%"


def free_step_memory(model) -> None:
    """Drop the last step's gradients (zero megatron DDP's main_grad buffers where the model has them) and return
    cached blocks, so every step starts from weights and batch."""
    for param in model.parameters():
        param.grad = None
    if hasattr(model, "zero_grad_buffer"):  # megatron's DDP (--grad-accum-fusion): gradients accumulate there
        model.zero_grad_buffer()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def snapshot_gradients(model, *, to_cpu: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter gradient by name (megatron DDP's `main_grad` where the model has one), detached copies (on
    the CPU with `to_cpu`, so another mode's peak is not charged for them and a 7B model's gradients are not held
    twice on the card; a copy there too: a CPU model's gradient buffer is zeroed in place by the next step)."""
    grads = {name: getattr(p, "main_grad", p.grad) for name, p in model.named_parameters()}
    return {
        name: (grad.detach().to("cpu", copy=True) if to_cpu else grad.detach().clone())
        for name, grad in grads.items()
        if grad is not None
    }
