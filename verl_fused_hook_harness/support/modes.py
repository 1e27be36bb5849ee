"""A mode: one way verl's engine computes the output layer, as the benchmarks and train-parity compare them.

Why one definition: `e2e-bench` and `train-parity` both run verl's engine once per mode and name the same
choices: verl's legacy fused forward or the output_processor hook (the environment switch), which kernel
computes (verl's, this package's, or verl's unfused full-logit forward), whether only the rows the loss reads
are scored, whether verl's ppo_loss runs inside the op, and whether log-probs are renormalized over the rollout's
kept sets (sampling replay). Each command keeps its own table of modes and turns a mode into the engine's
`fused_kernel_options` its way.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTED_SETS = "computed"
GIVEN_SETS = "given"


@dataclass(frozen=True)
class Mode:
    name: str
    hook: bool  # VERL_FUSED_USE_OP_HOOK: the output_processor hook, else verl's own path
    kernel: str  # "verl": verl's kernel; "ours": this package's; "unfused": verl's full-logit forward
    score_mask: bool = False  # only the rows the loss reads are computed
    fused_loss: bool = False  # fused_kernel_options.output_processor_fused_loss: ppo_loss inside the op
    cuda_only: bool = False
    # fused_kernel_options.output_processor_sampling_replay: the kept sets COMPUTED_SETS (from the rollout's top_k /
    # top_p on the trainer's logits) or GIVEN_SETS (the batch's rollout_kept_ids); None: replay off
    replay: str | None = None
    # The mode whose kernel arithmetic this one shares but for the loss's gradient (train-parity reports and
    # bounds the gap to it next to the gap to legacy).
    twin: str | None = None


def kernel_backends(device: str) -> dict[str, str]:
    """The backend each kernel name stands for on `device`: on CUDA verl's Triton kernel and ours
    (`triton`); on the CPU, where neither Triton kernel runs, the portable op for both."""
    return {"verl": "verl", "ours": "triton"} if device == "cuda" else {"verl": "torch", "ours": "torch"}
