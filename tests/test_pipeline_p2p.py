"""Why interleaved pipelining (VPP) at PP=2 hands a stage the wrong hidden state unless overlap_p2p_comm is on.

megatron-core 0.19.2's interleaved schedule, without `overlap_p2p_comm`, sends
both directions in one call (`send_forward_backward_recv_forward_backward`: the
activation to the next stage, the gradient to the previous one). At PP=2 both
neighbours are the same rank. Point-to-point messages between two ranks are
matched in the order they are posted:

- `_communicate_shapes` (used with `variable_seq_lengths=True`, which verl
  always sets) posts [send_prev, recv_prev, send_next, recv_next]: the peer's
  first receive (recv_prev) gets this rank's first send (send_prev, the
  gradient's shape), so the two shapes arrive swapped;
- the tensors themselves go through `_p2p_ops` (batch_p2p_comm=False), which
  orders them for two ranks (one direction on the global group): they arrive
  right, into buffers of the swapped shapes (gloo aborts: "Received data size
  doesn't match expected size", the 3072 vs 2560 bytes first seen);
- with `batch_p2p_comm=True` the tensors are posted in the same order as the
  shapes and arrive swapped as well: each stage silently receives the other
  direction's tensor (the 10-row hidden state for a 12-row micro-batch).

verl (mbridge's and Megatron-Bridge's config) sets `overlap_p2p_comm=True` and
`batch_p2p_comm=False` whenever VPP is on: the schedule then sends each
direction in a call of its own and nothing is swapped (tests/test_pipeline_parallel.py
runs VPP through verl's engine against an unsplit model). This test pins the
three facts on two gloo ranks, so a megatron-core that fixes the ordering shows
up here, and checks that hook mode refuses such an engine when it is built
(verl_integration/parallel_checks.py), naming the configuration.
"""

from __future__ import annotations

import pytest
import torch

from verl_fused_hook_harness.support.distributed import run_in_processes

HIDDEN = 4
FORWARD_ROWS, BACKWARD_ROWS = (5, 7), (3, 2)  # per rank: the activation it sends next, the gradient it sends back


def _communicator(variable_seq_lengths: bool, batch_p2p_comm: bool):
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    config = ModelParallelConfig(
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        variable_seq_lengths=variable_seq_lengths,
        batch_p2p_comm=batch_p2p_comm,
    )
    return P2PCommunicator(parallel_state.get_pipeline_model_parallel_group(), config)


def p2p_worker(rank, world_size, device="cpu"):
    """One call sending both directions, as the interleaved schedule makes it without overlap_p2p_comm (NCCL
    with device="cuda": tests/gpu/test_parallel_cuda.py)."""
    from verl_fused_hook_harness.stand_ins.cuda_on_cpu import cuda_names_on_cpu
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel

    init_model_parallel(1, pp_size=2)
    forward = torch.full((FORWARD_ROWS[rank], 1, HIDDEN), 10.0 + rank, device=device)  # for the next stage
    backward = torch.full((BACKWARD_ROWS[rank], 1, HIDDEN), 20.0 + rank, device=device)  # for the previous stage
    observed = {}
    with cuda_names_on_cpu():
        shapes = _communicator(True, False)._communicate_shapes(forward, backward, recv_prev=True, recv_next=True)
        observed["shapes"] = shapes
        for batched in (False, True):  # equal shapes: only the order of the tensors can go wrong
            same = (torch.full((6, 1, HIDDEN), 10.0 + rank, device=device),
                    torch.full((6, 1, HIDDEN), 20.0 + rank, device=device))  # fmt: skip
            received_prev, received_next, _ = _communicator(False, batched)._communicate(
                tensor_send_next=same[0], tensor_send_prev=same[1], recv_prev=True, recv_next=True,
                tensor_shape=(6, 1, HIDDEN),
            )  # fmt: skip
            observed[f"batched={batched}"] = (received_prev[0, 0, 0].item(), received_next[0, 0, 0].item())
        observed["refusal"] = hook_engine_refusal()
    return observed


def hook_engine_refusal() -> str | None:
    """Build verl's engine in hook mode at PP=2, VPP=2 with overlap_p2p_comm turned off: the build's error."""
    from verl_fused_hook_harness.support.parallel_engine import HOOK, ParallelCase, build_side_engine, init_layout
    from verl_fused_hook_harness.support.verl_engine import prepare_verl_process

    prepare_verl_process(torch.distributed.get_rank())
    case = ParallelCase("vpp2_no_overlap", 2, pp=2, vpp=2, layers=4, overrides=(("overlap_p2p_comm", False),))
    init_layout(case)
    try:
        build_side_engine(case, HOOK)
    except ValueError as error:
        return str(error)
    return None


@pytest.fixture(scope="module")
def observed():
    return run_in_processes(p2p_worker, 2)


def test_shape_exchange_swaps_directions_at_pp2(observed):
    """Each rank should get its peer's activation shape as recv_prev and gradient shape as recv_next: it gets
    them the other way round (megatron-core 0.19.2's `_communicate_shapes`)."""
    for rank, peer in ((0, 1), (1, 0)):
        recv_prev_shape, recv_next_shape = observed[rank]["shapes"]
        assert recv_prev_shape == [BACKWARD_ROWS[peer], 1, HIDDEN]  # correct would be FORWARD_ROWS[peer]
        assert recv_next_shape == [FORWARD_ROWS[peer], 1, HIDDEN]


def test_unbatched_tensors_arrive_in_order_batched_ones_swapped(observed):
    """Tensors of equal shapes: `_p2p_ops` delivers the activation to recv_prev; batched p2p delivers the
    gradient there (values 10+peer: the peer's activation, 20+peer: its gradient)."""
    for rank, peer in ((0, 1), (1, 0)):
        assert observed[rank]["batched=False"] == (10.0 + peer, 20.0 + peer)
        assert observed[rank]["batched=True"] == (20.0 + peer, 10.0 + peer)


def test_hook_mode_refuses_vpp_at_pp2_without_overlap(observed):
    """The engine build stops, naming the layout, the two settings and what to do."""
    for rank in (0, 1):
        message = observed[rank]["refusal"]
        assert message is not None and message.startswith("verl_fused_hook: virtual pipeline parallelism")
        for words in (
            "virtual_pipeline_model_parallel_size=2",
            "pipeline_model_parallel_size=2",
            "overlap_p2p_comm=False, batch_p2p_comm=False (variable_seq_lengths=True)",
            "override_transformer_config",
        ):
            assert words in message


@pytest.mark.parametrize(
    "settings, refused",
    [
        (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, overlap_p2p_comm=True), False),
        (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, overlap_p2p_comm=False), True),
        (dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, batch_p2p_comm=True), True),
        (dict(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2, overlap_p2p_comm=False), False),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=None, overlap_p2p_comm=False),
            False,
        ),
        (
            dict(
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                variable_seq_lengths=False,
                overlap_p2p_comm=False,
            ),
            False,
        ),
        (
            dict(
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                variable_seq_lengths=False,
                overlap_p2p_comm=False,
                batch_p2p_comm=True,
            ),
            True,
        ),
    ],
)
def test_which_layouts_are_refused(settings, refused):
    """Only VPP at PP=2 with both directions in one call: batched p2p (tensors swapped), or variable lengths
    without overlap (shapes swapped)."""
    from types import SimpleNamespace

    from verl_fused_hook.verl_integration.parallel_checks import unsupported_parallelism

    config = SimpleNamespace(
        **{"variable_seq_lengths": True, "overlap_p2p_comm": True, "batch_p2p_comm": False, **settings}
    )
    assert (unsupported_parallelism(config) is not None) == refused


def test_hook_mode_names_verls_limit_with_ep_communication_overlap():
    """overlap_moe_expert_parallel_comm trains through megatron's combined-1F1B schedule, which calls the forward
    step with return_schedule_plan=True; verl's forward_step has no such parameter (verl fails at its first
    training step, TypeError): hook mode says so at start-up."""
    import inspect
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel import combined_1f1b
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from verl_fused_hook.verl_integration.parallel_checks import unsupported_parallelism

    assert "return_schedule_plan=True" in inspect.getsource(combined_1f1b)
    assert "return_schedule_plan" not in inspect.signature(MegatronEngineWithLMHead.forward_step).parameters
    message = unsupported_parallelism(
        SimpleNamespace(pipeline_model_parallel_size=1, overlap_moe_expert_parallel_comm=True)
    )
    for words in (
        "overlap_moe_expert_parallel_comm=True",
        "return_schedule_plan=True",
        "verl's MegatronEngine.forward_step",
        "overlap_moe_expert_parallel_comm=False in override_transformer_config",
    ):
        assert words in message
