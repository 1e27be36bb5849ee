"""What every `ab-parity` comparison shares: the scenarios (TP size, sequence parallelism, tied embeddings), the
set-up every process of a run holds, the model each scenario builds, the tolerances, and how two runs' results
are compared and printed.

A run's result, per rank and per scenario key: {"mode", "log_probs", "entropy", "policy_loss", "grads",
"peak_bytes"} (tensors on the CPU); `compare_runs` takes the worst difference over all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...support.arguments import DTYPES
from ...support.compare import VALUES, differing_parameters, error, worst_gradient
from ...support.hf_model import build_gpt_from_hf, load_hf_config
from ...support.layer_spec import LOCAL, spec_overrides

ENV_VALUES = {"legacy": "0", "hook": "1"}  # VERL_FUSED_USE_OP_HOOK per mode
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
COMPARED = (*VALUES, "grads")


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
    dtype: str  # a key of support.arguments.DTYPES
    seed: int
    layout: str = "thd"  # "bshd": verl's padded layout, hook vs verl's unfused path (bshd.py)
    verbose: bool = False  # workers print a line per scenario
    layer_spec: str = LOCAL  # the resolved layer spec (support/layer_spec.py)
    batch_invariant: bool = False  # megatron's batch_invariant_mode (TE with FlashAttention 3/4)

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


def world_size_for(device: str, scenarios) -> int:
    """Processes per mode: the largest TP size asked for; on CUDA one per GPU, at most that many."""
    needed = max(s.tp for s in scenarios)
    return min(needed, torch.cuda.device_count()) if device == "cuda" else needed


def build_model(scenario: Scenario, setup: Setup, mtp_num_layers: int | None = None):
    """(hf_config, model): the scenario's GPTModel on `setup.device`, identical weights in every process."""
    from ...stand_ins.megatron_cpu import init_model_parallel  # imports megatron-core: only in worker processes

    init_model_parallel(scenario.tp, seed=setup.seed)
    hf_config = load_hf_config(setup.hf_path)
    model = build_gpt_from_hf(
        hf_config,
        sequence_parallel=scenario.sequence_parallel,
        tied=scenario.tied,
        seed=setup.seed,
        dtype=DTYPES[setup.dtype],
        mtp_num_layers=mtp_num_layers,
        layer_spec=setup.layer_spec,
        transformer_overrides=spec_overrides(batch_invariant=setup.batch_invariant) or None,
    )
    return hf_config, model.to(setup.device)


def gradients_of(model) -> dict[str, torch.Tensor]:
    """Every parameter gradient of `model` by name, detached, on the CPU."""
    return {name: p.grad.detach().cpu() for name, p in model.named_parameters() if p.grad is not None}


def compare_runs(runs_a, key_a: str, runs_b, key_b: str, *, relative: bool = False) -> dict:
    """Largest error per tensor over all ranks (absolute, or relative to run a's largest magnitude);
    for gradients the worst parameter too."""
    rows = {
        name: max(error(a[key_a][name], b[key_b][name], relative=relative) for a, b in zip(runs_a, runs_b))
        for name in VALUES
    }
    worst, worst_name = 0.0, None
    for a, b in zip(runs_a, runs_b):
        grads_a, grads_b = a[key_a]["grads"], b[key_b]["grads"]
        differ = differing_parameters(grads_a, grads_b)
        if differ:
            return {**rows, "grads": float("inf"), "worst_param": f"parameter sets differ: {differ}"}
        value, name = worst_gradient(grads_a, grads_b, relative=relative)
        if value > worst:
            worst, worst_name = value, name
    return {**rows, "grads": worst, "worst_param": worst_name}


def exact(rows: dict) -> bool:
    return all(rows[k] == 0.0 for k in COMPARED)


def within(rows: dict, tolerance: float) -> bool:
    return all(rows[k] <= tolerance for k in COMPARED)


TABLE_HEADER = (
    f"{'scenario':<18} {'compared':<28} {'log_probs':>10} {'entropy':>10} {'loss':>10} {'grads':>10}  worst grad"
)


def comparison_row(scenario: str, label: str, rows: dict, comment: str = "") -> str:
    """One line of the comparison table (TABLE_HEADER's columns)."""
    return (
        f"{scenario:<18} {label:<28} {rows['log_probs']:>10.3g} {rows['entropy']:>10.3g} {rows['policy_loss']:>10.3g} "
        f"{rows['grads']:>10.3g}  {rows['worst_param'] or '-'}{comment}"
    )


def peak_table(report: dict, reference_label: str) -> list[str]:
    """The peak-memory lines: per scenario the reference side's peak and hook mode's."""
    lines = [
        f"{'scenario':<18} {'peak ' + reference_label:>14} {'peak hook':>14}   "
        "(bytes of tensors alive during forward+backward)"
    ]
    for entry in report["scenarios"]:
        peaks = entry["peak_bytes"]
        lines.append(f"{entry['scenario']['name']:<18} {peaks['legacy']:>14,} {peaks['hook']:>14,}")
    return lines
