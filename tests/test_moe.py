"""MoE (megatron-core's MoE layer: 8 experts, top-2, load-balancing aux loss on) through verl's real engine on gloo:
expert parallelism EP=2, EP=2 x TP=2 (experts TP-sharded: megatron's default ETP = TP), PP=2 x EP=2, and MoE with
an MTP layer on the last stage of PP=2 and of PP=2 x VPP=2 (hook mode's MTP loss path, verl_integration/mtp.py).

The same comparisons as tests/test_pipeline_parallel.py (tests/parallel_cases.py): hook mode, with and without
the score mask and with the fused loss, equals verl's unfused path on every rank within 1e-5 relative (losses,
metrics including the MTP loss, log-probs, entropy, every gradient), and verl's path equals the same model
without the expert and pipeline split (EP=1, PP=1; weights by global expert and layer index). On the CPU the MoE
layer needs the stand-ins of verl_fused_hook_harness/stand_ins/moe_cpu.py.
"""

from __future__ import annotations

import pytest
from parallel_cases import CASES, case_results, reference_differences, side_differences

from verl_fused_hook_harness.support.parallel_engine import HOOK, HOOK_FUSED_LOSS, HOOK_NO_MASK, UNFUSED

MOE_CASES = ("ep2", "ep2_tp2", "pp2_ep2", "pp2_moe_mtp", "vpp2_moe_mtp")


@pytest.mark.parametrize("side", (HOOK, HOOK_NO_MASK, HOOK_FUSED_LOSS))
@pytest.mark.parametrize("name", MOE_CASES)
def test_hook_mode_equals_verl_unfused(name, side):
    assert side_differences(name, side) == []


@pytest.mark.parametrize("name", MOE_CASES)
def test_expert_and_pipeline_split_equal_the_unsplit_model(name):
    assert reference_differences(name) == []


@pytest.mark.parametrize("name", MOE_CASES)
def test_the_moe_layout_ran(name):
    """verl built MoE layers as configured (experts, top-k, aux loss, EP and expert-TP sizes, MTP), each DP rank
    trained on its own data, and every parameter but experts no token was routed to (router, MTP layer, the
    other experts) got a non-zero gradient."""
    case, ranks = CASES[name], case_results(name)
    for sides in ranks:
        layout = sides[HOOK]["layout"]
        assert (layout["num_moe_experts"], layout["moe_router_topk"]) == (8, 2)
        assert (layout["moe_router_load_balancing_type"], layout["moe_aux_loss_coeff"]) == ("aux_loss", 0.01)
        assert layout["expert_model_parallel_size"] == case.ep and layout["expert_tensor_parallel_size"] == case.tp
        assert layout["mtp_num_layers"] == (1 if case.mtp else None)
        grads = sides[UNFUSED]["grads"]
        trained = {key: float(grad.abs().max()) > 0 for key, grad in grads.items()}
        assert all(value for key, value in trained.items() if ".local_experts." not in key)
        experts = [value for key, value in trained.items() if ".local_experts." in key]
        assert experts and sum(experts) > len(experts) / 2
        assert any(".router." in key for key in grads)
    if case.ep > 1:  # data-parallel ranks saw different batches, so their losses differ
        losses = {tuple(sides[HOOK]["losses"]) for sides in ranks if sides[HOOK]["losses"]}
        assert len(losses) == case.dp


def test_mtp_loss_is_logged_and_trained_on_the_last_stage():
    """The MTP layer lives on the last stage; its loss is one of verl's metrics there (compared above) and its
    parameters are trained."""
    ranks = case_results("pp2_moe_mtp")
    last = ranks[-1]
    for side in (UNFUSED, HOOK, HOOK_FUSED_LOSS):
        assert last[side]["metrics"]["mtp_losses/mtp_1_loss"][0] > 0
        assert any(key.startswith("mtp.") for key in last[side]["grads"])
    assert not any(key.startswith("mtp.") for key in ranks[0][HOOK]["grads"])
