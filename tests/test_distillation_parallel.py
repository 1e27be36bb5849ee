"""verl's on-policy distillation under pipeline, context and tensor parallelism and with MTP, through verl's real
engine on gloo (the shared launches of tests/parallel_cases.py).

Each case runs verl's `train_batch` with `distillation_ppo_loss` (support/distillation.py's setups: forward_kl_topk
with both clamps binding, or the k3 estimator) on packed GRPO micro-batches carrying a teacher's top-k, once on
verl's unfused path and once in hook mode: PP=2 with an MTP layer (the distillation outputs on the last stage, the
MTP loss through the op), CP=2 and TP=2 x CP=2 (the teacher split over the CP ranks as the labels, the outputs
gathered by verl's unpacking), and k3 inside the op under CP=2. Hook mode must equal verl's unfused path on every
rank within 1e-5: each micro-batch's loss, every metric, every model output verl's loss reads on the response
rows (`distillation_losses`, `student_mass`, `teacher_mass`, `overlap_count`, `overlap_token_advantage`, log-probs,
entropy), every parameter gradient; under PP, verl's path must equal the unsplit model.

What verl refuses: distillation with dynamic context parallelism (`_check_dcp_unsupported_features`) and top-k
distillation with `pad_to_length` (its `forward_step`); hook mode leaves both refusals to verl.
"""

from __future__ import annotations

import pytest
from parallel_cases import CASES, case_results, reference_differences, side_differences

from verl_fused_hook_harness.support.parallel_engine import HOOK, HOOK_FUSED_LOSS

TOPK_CASES = ("pp2_mtp_distill", "cp2_distill", "tp2_cp2_distill")
MICRO_BATCHES = 4


@pytest.mark.parametrize("name", TOPK_CASES)
def test_topk_distillation_in_hook_mode_equals_verl_unfused(name):
    assert side_differences(name, HOOK) == []


@pytest.mark.parametrize("name", TOPK_CASES)
def test_the_distillation_outputs_reach_verls_loss(name):
    """On the ranks that compute the loss both sides hold verl's five outputs and its distillation metrics (the
    comparison above would pass on sides that held none)."""
    case = CASES[name]
    for sides in case_results(name):
        if not sides[HOOK]["losses"]:
            continue  # a pipeline stage before the last
        assert len(sides[HOOK]["losses"]) == MICRO_BATCHES
        assert {"distillation_losses", "overlap_count", "student_mass"} <= set(sides[HOOK])
        assert {"distillation/loss", "distillation/overlap_ratio", "distillation/teacher_mass"} <= set(
            sides[HOOK]["metrics"]
        )
        layout = sides[HOOK]["layout"]
        assert layout["context_parallel_size"] == case.cp and layout["pipeline_model_parallel_size"] == case.pp
        assert layout["tensor_model_parallel_size"] == case.tp and layout["use_fused_kernels"]
        assert layout["mtp_num_layers"] == (1 if case.mtp else None)


def test_pipeline_distillation_equals_the_unsplit_model():
    assert reference_differences("pp2_mtp_distill") == []


def test_estimator_loss_inside_the_op_under_cp_equals_verl_unfused():
    assert side_differences("cp2_distill_k3", HOOK_FUSED_LOSS) == []
    for sides in case_results("cp2_distill_k3"):
        assert sides[HOOK_FUSED_LOSS]["fused_loss_calls"] == MICRO_BATCHES
        assert "distillation/abs_loss" in sides[HOOK_FUSED_LOSS]["metrics"]
