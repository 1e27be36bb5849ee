"""Pipeline parallelism through verl's real engine on gloo: PP=2 and PP=4 (1F1B), VPP (2 model chunks per stage,
interleaved), PP x TP, VPP x TP, PP x CP, padded (BSHD) batches under PP, VPP and PP x CP, tied embeddings
under PP.

Each case runs verl's `train_batch` (`forward_backward_batch` through megatron's
schedule, DDP, optimizer) on packed GRPO micro-batches of different lengths,
once per side: verl's unfused path, hook mode (`VERL_FUSED_USE_OP_HOOK=1`) with
and without the score mask, and hook mode with `output_processor_fused_loss=true`
(tests/parallel_cases.py). Hook mode must equal verl's unfused path on every
rank within 1e-5 relative: each micro-batch's loss, every metric verl returns,
the response log-probs and entropy, every parameter gradient. verl's unfused
path must in turn equal the same model without the pipeline (PP=1, the same
weights by global layer), which is what sees a stage handed the wrong hidden
states: the fault tests inject exactly that and the comparisons must fail.
"""

from __future__ import annotations

import pytest
from parallel_cases import CASES, case_results, reference_differences, side_differences

from verl_fused_hook_harness.support.parallel_engine import HOOK, HOOK_FUSED_LOSS, HOOK_NO_MASK, REFERENCE, UNFUSED

PIPELINE_CASES = (
    "pp2",
    "vpp2",
    "pp2_bshd",
    "vpp2_bshd",
    "pp2_tied",
    "pp4",
    "pp2_tp2",
    "vpp2_tp2",
    "pp2_cp2",
    "pp2_cp2_bshd",
)
MICRO_BATCHES = 4


def on_last_stage(case, rank: int) -> bool:
    """Whether `rank` holds the last pipeline stage (megatron's rank order: the pipeline outermost)."""
    return rank // (case.world // case.pp) == case.pp - 1


@pytest.mark.parametrize("side", (HOOK, HOOK_NO_MASK, HOOK_FUSED_LOSS))
@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_hook_mode_equals_verl_unfused(name, side):
    assert side_differences(name, side) == []


@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_pipeline_equals_the_unsplit_model(name):
    """verl's unfused path under the pipeline equals the same model at PP=1 (every rank's parameters)."""
    assert reference_differences(name) == []


@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_the_layout_ran(name):
    """verl built what the case asks (the comparisons above would pass trivially on a model without a pipeline),
    only the last stage returned losses, and every parameter got a non-zero gradient."""
    case, ranks = CASES[name], case_results(name)
    for rank, sides in enumerate(ranks):
        layout = sides[HOOK]["layout"]
        assert layout["pipeline_model_parallel_size"] == case.pp and layout["tensor_model_parallel_size"] == case.tp
        assert layout["context_parallel_size"] == case.cp and layout["model_chunks"] == (case.vpp or 1)
        assert layout["variable_seq_lengths"] and layout["use_fused_kernels"]
        if case.vpp:
            assert layout["overlap_p2p_comm"] and not layout["batch_p2p_comm"]  # verl's own setting
        assert not sides[UNFUSED]["layout"]["use_fused_kernels"]
        assert len(sides[HOOK]["losses"]) == (MICRO_BATCHES if on_last_stage(case, rank) else 0)
        grads = sides[UNFUSED]["grads"]
        assert grads and all(float(grad.abs().max()) > 0 for grad in grads.values())
        assert set(grads) < set(sides[REFERENCE]["grads"])  # a stage holds part of the model


@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_fused_loss_ran_inside_the_op_on_the_last_stage(name):
    """ppo_loss inside the op for every micro-batch on the last stage (none elsewhere, where no loss exists);
    under CP as well (verl_integration/cp_loss.py), in the padded layout not (two-pass path, logged)."""
    case, ranks = CASES[name], case_results(name)
    for rank, sides in enumerate(ranks):
        last = bool(sides[HOOK_FUSED_LOSS]["losses"])
        expected = MICRO_BATCHES if last and not case.padded else 0
        assert sides[HOOK_FUSED_LOSS]["fused_loss_calls"] == expected, (
            rank,
            sides[HOOK_FUSED_LOSS]["fused_loss_calls"],
        )
        assert sides[HOOK]["fused_loss_calls"] == 0


@pytest.mark.parametrize("name", PIPELINE_CASES)
def test_the_last_stage_holds_one_micro_batchs_output_layer_input_at_a_time(name):
    """What a budget of kept logits (keep_logits_bytes) is held against: megatron's 1F1B and interleaved schedules
    run each micro-batch's backward through the output layer before the next one's output-layer forward on the last
    stage (its warm-up forwards are of earlier model chunks), so one micro-batch's kept logits exist at a time.
    Observed on every side: each last-stage rank's decoder output (the output layer's input) of every micro-batch
    gets its gradient before the next one is computed (tests/parallel_cases.py, observe_output_layer_inputs)."""
    case, ranks = CASES[name], case_results(name)
    for rank, sides in enumerate(ranks):
        alive = int(on_last_stage(case, rank))
        want = {"forwards": MICRO_BATCHES * alive, "backwards": MICRO_BATCHES * alive, "most_alive": alive}
        for side, result in sides.items():
            if side != REFERENCE:
                assert result["observed"] == want, (rank, side, result["observed"])


def test_a_shifted_hand_off_everywhere_is_seen_by_the_unsplit_model_only():
    """FAULT: every received row holds its predecessor's hidden state, in verl's path and in hook mode alike.
    Hook mode still equals verl's path (both are wrong the same way); the unsplit model sees it."""
    assert side_differences("pp2_shifted_rows_everywhere", HOOK) == []
    found = reference_differences("pp2_shifted_rows_everywhere")
    assert any("loss of micro-batch" in d for d in found) and any("gradient of" in d for d in found)


def test_a_shifted_hand_off_in_hook_mode_only_is_seen_against_verl():
    found = side_differences("pp2_shifted_rows_in_hook_mode", HOOK)
    assert any("loss of micro-batch" in d for d in found) and any("log_probs" in d for d in found)
    assert reference_differences("pp2_shifted_rows_in_hook_mode") == []  # verl's own path was left alone


def test_vpp_with_another_micro_batchs_hidden_states_fails():
    """FAULT: under VPP each receiving model chunk computes on the previous micro-batch's hidden states (what
    VPP at PP=2 without overlap_p2p_comm does, tests/test_pipeline_p2p.py). The VPP comparison catches it."""
    found = reference_differences("vpp2_stale_micro_batch_everywhere")
    assert any("loss of micro-batch" in d for d in found) and any("gradient of" in d for d in found)
