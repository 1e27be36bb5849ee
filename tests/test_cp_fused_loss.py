"""The fused loss (`output_processor_fused_loss=true`) under context parallelism, through verl's real engine on gloo.

Each CP rank holds two zigzag halves of every packed sequence, so its op scores its own rows only, and the CP
ranks score different numbers of rows: in chunks of a few rows (support/parallel_engine.FUSED_LOSS_CHUNK_GIB)
they run different numbers of chunks per micro-batch (on two ranks, e.g. 1 and 7, or 0 and 5). Hook mode gives
each chunk the loss's row gradients from the rank's own rows without a collective and evaluates verl's loss once
per call on every rank's values (verl_integration/cp_loss.py). It must equal verl's unfused path on every rank
within 1e-5: per micro-batch loss (verl's global normalisation, token-mean and seq-mean-token-mean), every
metric, every gradient; with the fast per-row form (vanilla) and with autograd of the loss on the rank's rows
(dppo_tv), at CP=2, TP=2 x CP=2 (sequence parallelism on) and PP=2 x CP=2. Sequence-level losses (gspo) are not
fused under CP: the two-pass path, the same numbers.
"""

from __future__ import annotations

import pytest
from parallel_cases import CASES, case_results, side_differences

from verl_fused_hook_harness.support.parallel_engine import HOOK, HOOK_FUSED_LOSS, HOOK_NO_MASK

FUSED_CASES = ("cp2", "cp2_seq_mean", "cp2_dppo_tv", "tp2_cp2", "pp2_cp2")
MICRO_BATCHES = 4


@pytest.mark.parametrize("side", (HOOK, HOOK_NO_MASK))
@pytest.mark.parametrize("name", ("cp2", "tp2_cp2"))
def test_hook_mode_under_cp_equals_verl_unfused(name, side):
    """Hook mode itself (the loss in verl's postprocess) at CP=2 and TP=2 x CP=2, with and without the score mask."""
    assert side_differences(name, side) == []


@pytest.mark.parametrize("name", (*FUSED_CASES, "cp2_gspo"))
def test_fused_loss_under_cp_equals_verl_unfused(name):
    assert side_differences(name, HOOK_FUSED_LOSS) == []


@pytest.mark.parametrize("name", FUSED_CASES)
def test_every_micro_batch_ran_its_loss_inside_the_op(name):
    case = CASES[name]
    for sides in case_results(name):
        layout = sides[HOOK_FUSED_LOSS]["layout"]
        assert layout["context_parallel_size"] == 2 and layout["tensor_model_parallel_size"] == case.tp
        assert layout["sequence_parallel"] == (case.tp > 1)
        on_last_stage = bool(sides[HOOK_FUSED_LOSS]["losses"])
        assert sides[HOOK_FUSED_LOSS]["fused_loss_calls"] == (MICRO_BATCHES if on_last_stage else 0)


def test_sequence_level_loss_takes_the_two_pass_path_under_cp():
    """gspo's row gradients need whole sequences, which CP splits over the ranks."""
    assert all(sides[HOOK_FUSED_LOSS]["fused_loss_calls"] == 0 for sides in case_results("cp2_gspo"))
