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

`--layout bshd` compares on verl's padded layout (`use_remove_padding=False`), where verl has no fused
path: hook mode against verl as it ships there (fused kernels off, its unfused BSHD forward), within the
unfused tolerance (tools/ab_bshd.py).

Usage: verl-fused-hook ab-parity [--device cpu|cuda] [--tp 1|2|4] [--hf-config PATH] [--backend NAME]
                                  [--dtype fp32|bf16] [--layout thd|bshd] [--json PATH|-] [--mtp-layers N]

`--mtp-layers N` runs the MTP scenario instead (tools/ab_parity_mtp.py, packed layout): models with N MTP
layers, hook mode's fused MTP loss against verl's own MTP path (fused kernels off), within the unfused tolerance.
Exit status: 0 when hook and legacy match (exactly with one kernel on both sides, within the kernels'
accuracy with two) and the hook matches the unfused forward, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..support.distributed import run_on_gloo
from ..support.memory import PeakMemory

ENV_VAR = "VERL_FUSED_USE_OP_HOOK"
MODES = {"legacy": "0", "hook": "1"}
TP_GAP = "legacy+tp-sum"
UNFUSED = "verl-unfused"
RERUN = "legacy-rerun"
# Fused vs verl's unfused forward (full fp32 logits): different arithmetic, so a tolerance, relative to the
# largest magnitude of the unfused tensor (fp32 rounding of a log-softmax over the vocabulary is ~1e-6).
UNFUSED_RTOL = 1e-4
# On CUDA the fused side is verl's Triton kernel, whose tl.dot takes fp32 inputs at TF32 precision (Triton's default).
UNFUSED_RTOL_CUDA = 2e-3
# bf16 models: verl's unfused forward rounds the logits (and the gradient it feeds back) to bf16, the fused
# kernels do not; on the Qwen2.5-7B-shaped model the worst parameter (the final norm's weight, tied output)
# moves by 2.4e-2 of its largest gradient, for legacy and hook alike. A sanity bound: fp32 runs check tightly.
UNFUSED_RTOL_BF16 = 5e-2
# Hook with another kernel than legacy's: each kernel is within 3e-5 of fp64 on log-probs and entropy
# (docs/benchmarks.md); bf16 gradients carry the bf16 rounding of d_hidden through the layers.
TWO_KERNEL_VALUE_TOL = 1e-4
TWO_KERNEL_GRAD_RTOL = 2e-2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TEMPERATURE = 0.7
CLIP = 0.2
ENTROPY_COEF = 0.01
PROMPT_LENS = (5, 9, 3, 7)
RESPONSE_LENS = (8, 4, 11, 6)


@dataclass(frozen=True)
class Scenario:
    tp: int
    sequence_parallel: bool
    tied: bool

    @property
    def name(self) -> str:
        return f"tp{self.tp}/{'sp' if self.sequence_parallel else 'nosp'}/{'tied' if self.tied else 'untied'}"

    @property
    def has_tp_gap(self) -> bool:
        return self.tp > 1 and not self.sequence_parallel


@dataclass(frozen=True)
class Setup:
    """What every process of a run shares: model config, dtype, device, the hook's backend, the seed."""

    hf_path: str
    backend: str
    device: str
    dtype: str  # a key of DTYPES
    seed: int
    layout: str = "thd"  # "bshd": verl's padded layout, hook vs verl's unfused path (tools/ab_bshd.py)

    @property
    def one_kernel(self) -> bool:
        """Both modes compute with one kernel (CPU: the portable op on both sides; CUDA: verl's)."""
        return self.device == "cpu" or self.backend == "verl"


SCENARIOS = (
    Scenario(1, False, False),
    Scenario(1, False, True),
    Scenario(2, False, False),
    Scenario(2, False, True),
    Scenario(2, True, False),
    Scenario(2, True, True),
)
# Run only when asked (--tp 4 or --scenarios): 4 processes a mode, and a model whose KV heads divide by 4
# (e.g. the shipped configs/tiny_qwen2_kv4).
TP4_SCENARIOS = (
    Scenario(4, False, False),
    Scenario(4, True, True),
)


def make_batch(vocab_size: int, seed: int):
    """Prompts, responses and per-sequence advantages/old-log-prob offsets; the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab_size, (n,), generator=generator) for n in PROMPT_LENS]
    responses = [torch.randint(0, vocab_size, (n,), generator=generator) for n in RESPONSE_LENS]
    advantages = torch.randn(len(PROMPT_LENS), generator=generator)
    old_offset = 0.05 * torch.randn(len(PROMPT_LENS), max(RESPONSE_LENS), generator=generator)
    return prompts, responses, advantages, old_offset


def grpo_loss(log_probs, entropy, data, advantages, old_offset):
    """Clipped policy-gradient loss minus an entropy bonus, over the response rows verl reads."""
    from verl.workers.utils.padding import no_padding_2_padding

    response_log_probs = no_padding_2_padding(log_probs, data)
    response_entropy = no_padding_2_padding(entropy, data)
    lengths = data["responses"].offsets().diff().to(response_log_probs.device)
    positions = torch.arange(response_log_probs.shape[1], device=response_log_probs.device)
    mask = positions.unsqueeze(0) < lengths.unsqueeze(1)
    old = response_log_probs.detach() + old_offset[:, : response_log_probs.shape[1]].to(mask.device)
    ratio = torch.exp(response_log_probs - old)
    adv = advantages.to(mask.device).unsqueeze(1)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    count = mask.sum()
    return (per_token * mask).sum() / count - ENTROPY_COEF * (response_entropy * mask).sum() / count


@contextlib.contextmanager
def legacy_kernel(device: str, backend: str, tp_sum: bool):
    """The kernel verl's legacy forward calls: portable on the CPU, verl's Triton on CUDA; optionally TP-summed."""
    from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
    from verl.models.mcore import model_forward_fused

    from verl_fused_hook_harness.stand_ins.legacy_kernel_swap import portable_legacy_kernel

    swap = portable_legacy_kernel(backend) if device == "cpu" else contextlib.nullcontext()
    with swap:
        kernel = model_forward_fused.linear_cross_entropy
        if tp_sum:
            model_forward_fused.linear_cross_entropy = lambda hidden, *rest: kernel(
                copy_to_tensor_model_parallel_region(hidden), *rest
            )
        try:
            yield
        finally:
            model_forward_fused.linear_cross_entropy = kernel


def peak_tracker(device: str):
    return contextlib.nullcontext() if device == "cuda" else PeakMemory()


def _prepared(scenario: Scenario, mode: str, setup: Setup):
    """Model, engine and batch of one scenario, identical in every process."""
    from verl.utils import tensordict_utils as tu

    from verl_fused_hook_harness.support.hf_model import build_gpt_from_hf, load_hf_config
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel
    from verl_fused_hook_harness.support.verl_engine import megatron_engine

    device = setup.device
    init_model_parallel(scenario.tp, seed=setup.seed)
    hf_config = load_hf_config(setup.hf_path)
    model = build_gpt_from_hf(
        hf_config,
        sequence_parallel=scenario.sequence_parallel,
        tied=scenario.tied,
        seed=setup.seed,
        dtype=DTYPES[setup.dtype],
    )
    model.to(device)
    options = {"output_processor_backend": setup.backend} if mode == "hook" else {}
    engine = megatron_engine([model], fused_kernel_options=options, model_path=setup.hf_path)

    prompts, responses, advantages, old_offset = make_batch(hf_config.vocab_size, setup.seed)
    nested = lambda parts: torch.nested.as_nested_tensor([p.to(device) for p in parts], layout=torch.jagged)  # noqa: E731
    input_ids = nested([torch.cat(pair) for pair in zip(prompts, responses)])
    data = tu.get_tensordict({"input_ids": input_ids, "prompts": nested(prompts), "responses": nested(responses)})
    return hf_config, model, engine, input_ids, data, advantages, old_offset


def _fused_forward(hf_config, model, engine, input_ids):
    """verl's fused engine forward (this process's mode)."""
    from verl_fused_hook_harness.support.verl_engine import fused_engine_forward

    return fused_engine_forward(engine, model, input_ids, TEMPERATURE)


def _unfused_forward(hf_config, model, engine, input_ids):
    """verl's unfused engine forward (full logits, vocab-parallel log-softmax): the ground truth."""
    import functools

    import verl.models.mcore as mcore
    from verl.utils.torch_functional import expand_as_nested

    processor = functools.partial(
        engine._lm_head_logits_processor,
        calculate_sum_pi_squared=False,
        calculate_entropy=True,
        distillation_use_topk=False,
        distillation_only=False,
        logits_processor_func=None,
        batch=None,
        data_format="thd",
    )
    temperature = expand_as_nested(torch.full((input_ids.shape[0],), TEMPERATURE, device=input_ids.device), input_ids)
    return mcore.get_mcore_engine_forward_fn(hf_config)(
        model,
        input_ids,
        {},
        logits_processor=processor,
        logits_processor_args={"label": input_ids.clone(), "temperature": temperature},
        pad_token_id=engine.model_config.tokenizer.pad_token_id,
        data_format="thd",
    )


def run_once(scenario: Scenario, mode: str, setup: Setup, variant: str) -> dict:
    """One forward+backward of one scenario; variant "fused" (this process's mode), "tp-sum" or "unfused".
    On CUDA deterministic (see the module docstring)."""
    from verl_fused_hook_harness.support.determinism import deterministic_steps

    device = setup.device
    hf_config, model, engine, input_ids, data, advantages, old_offset = _prepared(scenario, mode, setup)
    if variant != "unfused":
        engine._maybe_enable_fused_kernels()  # verl's build step, through the plugin's gate
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    tracker = peak_tracker(device)
    kernel = (
        legacy_kernel(device, setup.backend, tp_sum=variant == "tp-sum") if variant != "unfused" else contextlib.nullcontext()
    )
    repeatable = deterministic_steps(model) if device == "cuda" else contextlib.nullcontext()
    with kernel, tracker, repeatable:
        forward = _unfused_forward if variant == "unfused" else _fused_forward
        output = forward(hf_config, model, engine, input_ids)
        loss = grpo_loss(output["log_probs"], output["entropy"], data, advantages, old_offset)
        loss.backward()
    peak = torch.cuda.max_memory_allocated() - base if device == "cuda" else tracker.peak
    return {
        "mode": getattr(model, "_verl_fused_forward_mode", None) if variant != "unfused" else "unfused",
        "log_probs": output["log_probs"].values().detach().cpu(),
        "entropy": output["entropy"].values().detach().cpu(),
        "policy_loss": loss.detach().reshape(1).cpu(),
        "grads": {name: p.grad.detach().cpu() for name, p in model.named_parameters() if p.grad is not None},
        "peak_bytes": int(peak),
    }


def run_bshd(scenario: Scenario, mode: str, setup: Setup) -> dict:
    """The padded-layout scenario of one mode (tools/ab_bshd.py): verl as it ships, or hook mode. Held to a
    tolerance (two kinds of arithmetic), so it runs without the deterministic set-up."""
    from .ab_bshd import run_bshd_once

    hf_config, model, *_ = _prepared(scenario, mode, setup)
    return run_bshd_once(mode, setup, hf_config, model, peak_tracker(setup.device))


def mode_worker(rank: int, world_size: int, mode: str, scenarios, setup: Setup):
    """Every scenario in this process's mode (set by the environment); one result dict per run.

    On CUDA the legacy mode runs each scenario twice ("legacy:rerun"): the rerun must match exactly, which
    shows the deterministic set-up holds, so that a zero between modes means the modes agree."""
    from verl_fused_hook.verl_integration import install

    install()  # what `import verl` does through the entry point when the package is installed
    if rank != 0:
        logging.getLogger("verl_fused_hook").setLevel(logging.WARNING)  # one log line per engine, not per rank
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401  (fires the plugin's build gate)

    if setup.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    results = {}
    for scenario in scenarios:
        started = time.time()
        if setup.layout == "bshd":
            results[scenario.name] = run_bshd(scenario, mode, setup)
            if rank == 0:
                print(f"[{mode}] {scenario.name} bshd done in {time.time() - started:.1f}s", flush=True)
            continue
        results[scenario.name] = run_once(scenario, mode, setup, variant="fused")
        if mode == "legacy" and setup.device == "cuda":
            results[f"{scenario.name}:{RERUN}"] = run_once(scenario, mode, setup, variant="fused")
        if mode == "legacy" and scenario.has_tp_gap:
            results[f"{scenario.name}:{TP_GAP}"] = run_once(scenario, mode, setup, variant="tp-sum")
        if mode == "hook":
            results[f"{scenario.name}:{UNFUSED}"] = run_once(scenario, mode, setup, variant="unfused")
        if rank == 0:
            print(f"[{mode}] {scenario.name} done in {time.time() - started:.1f}s", flush=True)
    return results


def world_size_for(device: str, scenarios) -> int:
    """Processes per mode: the largest TP size asked for; on CUDA one per GPU, at most that many."""
    needed = max(s.tp for s in scenarios)
    return min(needed, torch.cuda.device_count()) if device == "cuda" else needed


def run_mode(mode: str, scenarios, setup: Setup):
    env = {ENV_VAR: MODES[mode]}
    world_size = world_size_for(setup.device, scenarios)
    if setup.device == "cuda":
        from verl_fused_hook_harness.support.distributed import free_port

        return _run_on_nccl(mode, scenarios, setup, env, free_port(), world_size)
    return run_on_gloo(mode_worker, world_size, mode, scenarios, setup, env=env)


def _nccl_worker(rank, world_size, port, folder, mode, scenarios, setup, env, worker=None, extra=()):
    import torch.distributed as dist

    from verl_fused_hook_harness.support.determinism import prepare_cublas_workspace

    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    prepare_cublas_workspace()  # before the first GEMM: deterministic runs need it
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    try:
        result = (worker or mode_worker)(rank, world_size, mode, scenarios, setup, *extra)
        torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _run_on_nccl(mode, scenarios, setup, env, port, world_size, worker=None, extra=()):
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(
            _nccl_worker,
            args=(world_size, port, folder, mode, scenarios, setup, env, worker, extra),
            nprocs=world_size,
            start_method="spawn",
        )
        return [torch.load(os.path.join(folder, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _error(reference: torch.Tensor, other: torch.Tensor, relative: bool) -> float:
    error = max_abs(reference, other)
    if not relative or error in (0.0, float("inf")):
        return error
    scale = reference.double().abs().max().item()
    return error / scale if scale > 0 else error


def compare(runs_a, key_a: str, runs_b, key_b: str, *, relative: bool = False) -> dict:
    """Largest error per tensor over all ranks (absolute, or relative to run a's largest magnitude);
    for gradients the worst parameter too."""
    rows = {}
    for tensor in ("log_probs", "entropy", "policy_loss"):
        rows[tensor] = max(_error(a[key_a][tensor], b[key_b][tensor], relative) for a, b in zip(runs_a, runs_b))
    worst, worst_name = 0.0, None
    for a, b in zip(runs_a, runs_b):
        grads_a, grads_b = a[key_a]["grads"], b[key_b]["grads"]
        if grads_a.keys() != grads_b.keys():
            differ = sorted(grads_a.keys() ^ grads_b.keys())
            return {**rows, "grads": float("inf"), "worst_param": f"parameter sets differ: {differ}"}
        for name in grads_a:
            value = _error(grads_a[name], grads_b[name], relative)
            if value > worst:
                worst, worst_name = value, name
    rows["grads"] = worst
    rows["worst_param"] = worst_name
    return rows


def _exact(rows: dict) -> bool:
    return all(rows[k] == 0.0 for k in ("log_probs", "entropy", "policy_loss", "grads"))


def _within(rows: dict, tolerance: float) -> bool:
    return all(rows[k] <= tolerance for k in ("log_probs", "entropy", "policy_loss", "grads"))


def _row(scenario: str, label: str, rows: dict, comment: str = "") -> str:
    return (
        f"{scenario:<18} {label:<28} {rows['log_probs']:>10.3g} {rows['entropy']:>10.3g} {rows['policy_loss']:>10.3g} "
        f"{rows['grads']:>10.3g}  {rows['worst_param'] or '-'}{comment}"
    )


def _within_kernel_accuracy(absolute: dict, relative: dict) -> bool:
    """Two kernels: values within TWO_KERNEL_VALUE_TOL (absolute), gradients within TWO_KERNEL_GRAD_RTOL."""
    values = all(absolute[k] <= TWO_KERNEL_VALUE_TOL for k in ("log_probs", "entropy", "policy_loss"))
    return values and relative["grads"] <= TWO_KERNEL_GRAD_RTOL


def evaluate(scenario: Scenario, runs: dict, one_kernel: bool = True, rtol: float = UNFUSED_RTOL) -> dict:
    """One scenario's report entry: legacy/hook parity (exact with one kernel, within the kernels' accuracy
    with two), the legacy rerun (exact, where run) and both modes against verl's unfused forward."""
    name = scenario.name
    entry = {"scenario": asdict(scenario) | {"name": name}}
    entry["modes_resolved"] = {mode: runs[mode][0][name]["mode"] for mode in MODES}
    entry["peak_bytes"] = {mode: max(r[name]["peak_bytes"] for r in runs[mode]) for mode in MODES}
    legacy_key = f"{name}:{TP_GAP}" if scenario.has_tp_gap else name
    entry["compared_against"] = TP_GAP if scenario.has_tp_gap else "legacy"
    entry["max_abs"] = compare(runs["legacy"], legacy_key, runs["hook"], name)
    if not one_kernel:
        entry["rel"] = compare(runs["legacy"], legacy_key, runs["hook"], name, relative=True)
    rerun = f"{name}:{RERUN}"
    if rerun in runs["legacy"][0]:
        entry["legacy_rerun"] = compare(runs["legacy"], name, runs["legacy"], rerun)
    if scenario.has_tp_gap:
        entry["vs_legacy_expected_gap"] = compare(runs["legacy"], name, runs["hook"], name)
    reference = f"{name}:{UNFUSED}"
    entry["vs_unfused_rel"] = {
        "hook": compare(runs["hook"], reference, runs["hook"], name, relative=True),
        "legacy": compare(runs["hook"], reference, runs["legacy"], name, relative=True),
    }
    parity = _exact(entry["max_abs"]) if one_kernel else _within_kernel_accuracy(entry["max_abs"], entry["rel"])
    entry["match"] = (
        entry["modes_resolved"] == {"legacy": "legacy", "hook": "hook"}
        and parity
        and ("legacy_rerun" not in entry or _exact(entry["legacy_rerun"]))
        and _within(entry["vs_unfused_rel"]["hook"], rtol)
    )
    return entry


def print_report(report: dict) -> None:
    print()
    print(f"{'scenario':<18} {'compared':<28} {'log_probs':>10} {'entropy':>10} {'loss':>10} {'grads':>10}  worst grad")
    for entry in report["scenarios"]:
        name = entry["scenario"]["name"]
        mismatch = "" if entry["match"] else "   MISMATCH"
        print(_row(name, f"hook vs {entry['compared_against']} (abs)", entry["max_abs"], mismatch))
        if "rel" in entry:
            print(_row("", f"hook vs {entry['compared_against']} (rel)", entry["rel"], "  two kernels: accuracy bounds"))
        if "legacy_rerun" in entry:
            print(_row("", "legacy vs legacy rerun (abs)", entry["legacy_rerun"], "  must be 0: repeatable runs"))
        if "vs_legacy_expected_gap" in entry:
            print(_row("", "hook vs legacy (abs)", entry["vs_legacy_expected_gap"], "  expected: the TP gradient sum"))
        print(_row("", f"hook vs {UNFUSED} (rel)", entry["vs_unfused_rel"]["hook"]))
        gap = entry["scenario"]["tp"] > 1 and not entry["scenario"]["sequence_parallel"]
        wrong = "  verl's legacy gradient is wrong here" if gap else ""
        print(_row("", f"legacy vs {UNFUSED} (rel)", entry["vs_unfused_rel"]["legacy"], wrong))
    print()
    print(f"{'scenario':<18} {'peak legacy':>14} {'peak hook':>14}   (bytes of tensors alive during forward+backward)")
    for entry in report["scenarios"]:
        peaks = entry["peak_bytes"]
        print(f"{entry['scenario']['name']:<18} {peaks['legacy']:>14,} {peaks['hook']:>14,}")
    print()
    unfused = f"within {report['unfused_rtol']:g} of verl's unfused forward"
    if not report["match"]:
        print("FAIL: mismatches above")
    elif not report["one_kernel"]:
        print(f"PASS: hook (backend={report['backend']}) within the kernels' accuracy of legacy (values <= "
              f"{TWO_KERNEL_VALUE_TOL:g}, gradients <= {TWO_KERNEL_GRAD_RTOL:g} relative) and {unfused}")
    elif report["device"] == "cuda":
        print(f"PASS: hook and legacy identical (max_abs = 0; the legacy rerun identical too) and {unfused}")
    else:
        print(f"PASS: hook and legacy identical (max_abs = 0) and {unfused}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-config", default=None, help="HF config.json or folder (default: the shipped tiny Qwen2)")
    parser.add_argument(
        "--backend", default=None, help="the hook's op backend (default: verl on CUDA, torch on CPU: legacy's own kernel)"
    )
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="model dtype (default: bf16 with --backend triton, else fp32)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when a GPU is there, else cpu")
    parser.add_argument("--tp", type=int, choices=(1, 2, 4), default=None, help="only the scenarios of this TP size (4: also pass a model whose KV heads divide by 4, e.g. verl_fused_hook_harness/configs/tiny_qwen2_kv4)")
    parser.add_argument("--scenarios", default=None, help="comma-separated names, e.g. tp1/nosp/untied (default: all)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--layout", choices=("thd", "bshd"), default="thd",
        help="thd (default): legacy vs hook on packed batches; bshd: verl's padded layout (use_remove_padding=False), "
        "hook vs verl as it ships there (fused kernels off: its unfused forward)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON (- for stdout)")
    parser.add_argument("--mtp-layers", type=int, default=0, metavar="N",
                        help="MTP scenario: models with N MTP layers, hook mode's fused MTP loss vs verl's MTP path "
                             "(tools/ab_parity_mtp.py); 0 (default): the legacy/hook comparison")
    args = parser.parse_args(argv)
    if args.mtp_layers < 0:
        parser.error(f"--mtp-layers: expected an int >= 0, got {args.mtp_layers}")
    if args.mtp_layers and args.layout == "bshd":
        parser.error("--mtp-layers: the MTP scenario runs on the packed layout; drop --layout bshd")

    from verl_fused_hook.switch import allowed_backends
    from verl_fused_hook_harness.support.hf_model import TINY_QWEN2

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    backend = args.backend or ("verl" if device == "cuda" else "torch")
    if backend not in allowed_backends():
        parser.error(f"--backend {backend!r}: allowed {', '.join(allowed_backends())}")
    dtype = args.dtype or ("bf16" if backend == "triton" else "fp32")
    if backend == "triton" and dtype != "bf16":
        parser.error("--backend triton takes bf16 hidden states and weights: use --dtype bf16")
    if device == "cpu" and backend in ("verl", "triton"):
        parser.error(f"--backend {backend} needs CUDA (a Triton kernel); on the CPU use torch")
    hf_path = Path(args.hf_config) if args.hf_config else TINY_QWEN2
    if not hf_path.exists():
        parser.error(f"--hf-config: {hf_path} does not exist; pass a config.json or a folder holding one")
    hf_path = str(hf_path.parent if hf_path.is_file() else hf_path)
    known = SCENARIOS + TP4_SCENARIOS
    scenarios = TP4_SCENARIOS if args.tp == 4 else SCENARIOS
    if args.scenarios:
        wanted = set(args.scenarios.split(","))
        unknown = wanted - {s.name for s in known}
        if unknown:
            parser.error(f"--scenarios: unknown {sorted(unknown)}; allowed: {', '.join(s.name for s in known)}")
        scenarios = tuple(s for s in known if s.name in wanted)
    if args.tp is not None:
        scenarios = tuple(s for s in scenarios if s.tp == args.tp)
    if not scenarios:
        parser.error("--scenarios/--tp: no scenario left to run")
    world_size = world_size_for(device, scenarios)
    too_big = [s.name for s in scenarios if s.tp > world_size]
    if too_big and (args.scenarios or args.tp):
        parser.error(f"{', '.join(too_big)}: need {max(s.tp for s in scenarios)} processes, {device} gives {world_size}")
    if too_big:
        print(f"skipped ({world_size} GPU(s) here, too few for): {', '.join(too_big)}", flush=True)
        scenarios = tuple(s for s in scenarios if s.tp <= world_size)
    rtol = UNFUSED_RTOL_BF16 if dtype == "bf16" else UNFUSED_RTOL_CUDA if device == "cuda" else UNFUSED_RTOL
    setup = Setup(hf_path=hf_path, backend=backend, device=device, dtype=dtype, seed=args.seed, layout=args.layout)
    if args.mtp_layers:
        from .ab_parity_mtp import run_mtp_parity

        return run_mtp_parity(scenarios, setup, args.mtp_layers, rtol, args.json)

    kernel_note = (
        "both modes use the portable op (backend=%s); verl's Triton kernel needs CUDA, so the legacy forward's "
        "kernel was swapped for it" % backend
        if device == "cpu"
        else f"legacy uses verl's Triton kernel; hook uses backend={backend}"
    )
    if args.layout == "bshd":
        kernel_note = f"padded (BSHD) layout: verl as it ships (fused kernels off, unfused forward) vs hook backend={backend}"
    print(f"A/B parity on {device} ({world_size} processes per mode), model {hf_path} in {dtype}; {kernel_note}",
          flush=True)
    runs = {mode: run_mode(mode, scenarios, setup) for mode in MODES}

    report = {"device": device, "backend": backend, "dtype": dtype, "one_kernel": setup.one_kernel,
              "hf_config": hf_path, "kernel_note": kernel_note, "unfused_rtol": rtol, "layout": args.layout}
    if args.layout == "bshd":
        from .ab_bshd import evaluate_bshd, print_bshd_report

        report["scenarios"] = [evaluate_bshd(scenario, runs, rtol) for scenario in scenarios]
        report["match"] = all(entry["match"] for entry in report["scenarios"])
        print_bshd_report(report)
    else:
        report["scenarios"] = [evaluate(scenario, runs, setup.one_kernel, rtol) for scenario in scenarios]
        report["match"] = all(entry["match"] for entry in report["scenarios"])
        print_report(report)
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0 if report["match"] else 1


if __name__ == "__main__":
    sys.exit(main())
