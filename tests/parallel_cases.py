"""The parallel layouts the CPU tests run through verl's engine, launched once per world size for every test file.

Why shared: process start-ups (verl, megatron-core, ray imports) cost most of a
case's time, so tests/test_pipeline_parallel.py, tests/test_moe.py and
tests/test_cp_fused_loss.py read one 2-process and one 4-process launch
(`results(world)`, cached for the pytest session) instead of starting their own.

Also here: the test-only faults injected into a stage hand-off (never a runtime
switch): functions given each engine of a faulty side after its build, which
change what a non-first pipeline stage receives; and an observer of when the
output layer's input is alive, which changes nothing. And the judge of two sides (`differences`): a list of
what differs, named, rather than asserts, so that one check passes for hook mode against verl's unfused path
and fails, saying what broke, where a fault was injected.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch

from verl_fused_hook_harness.support.parallel_compare import ABS_FLOOR, RTOL, flatten, tensor_error
from verl_fused_hook_harness.support.parallel_engine import (
    HOOK,
    HOOK_FUSED_LOSS,
    MODEL_OUTPUT_KEYS,
    REFERENCE,
    SIDES,
    UNFUSED,
    CaseRun,
    ParallelCase,
    run_launch,
)

# ---------------------------------------------------------------- test-only faults at the stage hand-off


def _on_received_hidden_states(engine, transform) -> None:
    """Every model chunk that receives hidden states from a previous stage sees transform(them) instead;
    gradients still flow back to what was received, so the schedule runs as before."""
    from verl_fused_hook.probe import unwrap_to_gpt

    for chunk in engine.module:
        gpt = unwrap_to_gpt(chunk)
        if gpt.pre_process:
            continue
        receive = gpt.set_input_tensor

        def set_input_tensor(input_tensor, receive=receive):
            tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
            receive([None if t is None else transform(t) for t in tensors])

        gpt.set_input_tensor = set_input_tensor


def fault_shifted_rows(engine) -> None:
    """FAULT (tests only): each received row holds its predecessor's hidden state: the last stage scores the
    wrong rows."""
    _on_received_hidden_states(engine, lambda hidden: torch.roll(hidden, shifts=1, dims=0))


def fault_stale_micro_batch(engine) -> None:
    """FAULT (tests only): a stage computes on the hidden states it received for the previous micro-batch (cut or
    zero-padded to this one's rows), the error VPP at PP=2 makes without overlap_p2p_comm."""
    previous = {}

    def stale(hidden):
        before = previous.get("hidden")
        previous["hidden"] = hidden.detach()
        if before is None:
            return hidden
        fitted = torch.zeros_like(hidden)
        rows = min(hidden.shape[0], before.shape[0])
        fitted[:rows] = before[:rows]
        return hidden + (fitted - hidden).detach()

    _on_received_hidden_states(engine, stale)


# ---------------------------------------------------------------- observer: output-layer inputs awaiting backward


def observe_output_layer_inputs(engine):
    """Counts, on the chunk that holds the output layer, the decoder outputs (the output layer's input) from their
    forward until their gradient is computed, which is after the output layer's backward: what keeps a micro-batch's
    kept logits (keep_logits_bytes) alive. Returns a callable giving forwards, backwards and the most alive at once."""
    from verl_fused_hook.probe import unwrap_to_gpt

    counts = {"forwards": 0, "backwards": 0, "most_alive": 0}

    def backward_done(grad):
        counts["backwards"] += 1

    def after_decoder(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if not hidden.requires_grad:
            return
        counts["forwards"] += 1
        counts["most_alive"] = max(counts["most_alive"], counts["forwards"] - counts["backwards"])
        hidden.register_hook(backward_done)

    for chunk in engine.module:
        gpt = unwrap_to_gpt(chunk)
        if gpt.post_process:
            gpt.decoder.register_forward_hook(after_decoder)
    return lambda: dict(counts)


# ---------------------------------------------------------------- the cases

CASES = {
    case.name: case
    for case in (
        # 2 processes
        ParallelCase("pp2", 2, pp=2),
        ParallelCase("vpp2", 2, pp=2, vpp=2, layers=4),
        ParallelCase("pp2_bshd", 2, pp=2, padded=True),
        ParallelCase("vpp2_bshd", 2, pp=2, vpp=2, layers=4, padded=True),
        ParallelCase("pp2_tied", 2, pp=2, tied=True),
        ParallelCase("ep2", 2, ep=2, experts=8),
        ParallelCase("pp2_moe_mtp", 2, pp=2, experts=8, mtp=True),
        ParallelCase("vpp2_moe_mtp", 2, pp=2, vpp=2, layers=4, experts=8, mtp=True),
        ParallelCase("cp2", 2, cp=2),
        ParallelCase("cp2_seq_mean", 2, cp=2, loss_agg_mode="seq-mean-token-mean"),
        ParallelCase("cp2_dppo_tv", 2, cp=2, loss_mode="dppo_tv"),
        ParallelCase("cp2_gspo", 2, cp=2, loss_mode="gspo"),
        ParallelCase("pp2_mtp_distill", 2, pp=2, mtp=True, distillation="topk"),
        ParallelCase("cp2_distill", 2, cp=2, distillation="topk"),
        ParallelCase("cp2_distill_k3", 2, cp=2, distillation="k3"),
        # 4 processes
        ParallelCase("pp4", 4, pp=4, layers=4),
        ParallelCase("pp2_tp2", 4, pp=2, tp=2),
        ParallelCase("vpp2_tp2", 4, pp=2, vpp=2, tp=2, layers=4),
        ParallelCase("pp2_cp2", 4, pp=2, cp=2),
        ParallelCase("pp2_cp2_bshd", 4, pp=2, cp=2, padded=True),
        ParallelCase("ep2_tp2", 4, ep=2, tp=2, experts=8),
        ParallelCase("pp2_ep2", 4, pp=2, ep=2, experts=8),
        ParallelCase("tp2_cp2", 4, tp=2, cp=2),
        ParallelCase("tp2_cp2_distill", 4, tp=2, cp=2, distillation="topk"),
    )
}
FAULTS = {
    # name: (case, fault, faulty sides)
    "pp2_shifted_rows_everywhere": (CASES["pp2"], fault_shifted_rows, (UNFUSED, HOOK)),
    "pp2_shifted_rows_in_hook_mode": (CASES["pp2"], fault_shifted_rows, (HOOK,)),
    "vpp2_stale_micro_batch_everywhere": (CASES["vpp2"], fault_stale_micro_batch, (UNFUSED, HOOK)),
}
SHORT_SIDES = {
    name: (UNFUSED, HOOK_FUSED_LOSS) for name in ("cp2_seq_mean", "cp2_dppo_tv", "cp2_gspo", "cp2_distill_k3")
}
SHORT_SIDES.update({name: (UNFUSED, HOOK) for name in ("pp2_mtp_distill", "cp2_distill", "tp2_cp2_distill")})


def _runs(world: int) -> list[CaseRun]:
    runs = [
        CaseRun(case, SHORT_SIDES.get(name, SIDES), observer=observe_output_layer_inputs)
        for name, case in CASES.items()
        if case.world == world
    ]
    for name, (case, fault, faulty) in FAULTS.items():
        if case.world == world:
            runs.append(CaseRun(replace(case, name=name), (UNFUSED, HOOK), fault, faulty))
    return runs


@functools.cache
def results(world: int) -> dict:
    """{case or fault name: [per rank {side: result}]} for every case and fault of `world` processes."""
    per_rank = run_launch(_runs(world))
    return {name: [rank[name] for rank in per_rank] for name in per_rank[0]}


def case_results(name: str) -> list[dict]:
    world = CASES[name].world if name in CASES else FAULTS[name][0].world
    return results(world)[name]


# ---------------------------------------------------------------- judging a side: what differs, named


def _close(want: float, got: float, rtol: float) -> bool:
    return abs(got - want) <= rtol * max(abs(want), ABS_FLOOR / rtol)


def differences(want: dict, got: dict, *, rtol: float = RTOL, gradients_of_got_only: bool = False) -> list[str]:
    """What differs between two results of `run_side` on one rank beyond `rtol` (empty: they agree).

    gradients_of_got_only: `got` holds a part of `want`'s parameters (a pipeline stage or an expert shard of
    the reference's unsplit model): compare those. Losses and metrics are compared where `got` has them (the
    last pipeline stage)."""
    found = []
    if got["losses"]:
        if len(got["losses"]) != len(want["losses"]):
            found.append(f"losses: {len(got['losses'])} micro-batches vs {len(want['losses'])}")
        else:
            for index, (w, g) in enumerate(zip(want["losses"], got["losses"])):
                if not _close(w, g, rtol):
                    found.append(f"loss of micro-batch {index}: {g!r} vs {w!r}")
    if got["metrics"]:
        if set(got["metrics"]) != set(want["metrics"]):
            found.append(f"metric keys: {sorted(set(got['metrics']) ^ set(want['metrics']))} on one side only")
        for key in sorted(set(got["metrics"]) & set(want["metrics"])):
            w, g = flatten(want["metrics"][key]), flatten(got["metrics"][key])
            if len(w) != len(g) or not all(_close(a, b, rtol) for a, b in zip(w, g)):
                found.append(f"metric {key}: {got['metrics'][key]!r} vs {want['metrics'][key]!r}")
    for key in MODEL_OUTPUT_KEYS:
        if got["losses"] and (key in want) != (key in got):  # on the last stage
            found.append(f"model output {key}: held by one side only")
        elif key in got and tensor_error(want[key], got[key]) > rtol:
            found.append(f"{key}: relative error {tensor_error(want[key], got[key]):.3g}")
    names = set(got["grads"]) if gradients_of_got_only else set(got["grads"]) | set(want["grads"])
    missing = sorted(names - set(want["grads"]) | names - set(got["grads"]))
    if missing:
        found.append(f"gradients held by one side only: {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for name in sorted(names - set(missing)):
        error = tensor_error(want["grads"][name], got["grads"][name])
        if error > rtol:
            found.append(f"gradient of {name}: relative error {error:.3g}")
    return found


def side_differences(name: str, side: str) -> list[str]:
    """Every rank's differences of `side` from verl's unfused path, prefixed by the rank."""
    return [
        f"rank {rank}: {d}"
        for rank, sides in enumerate(case_results(name))
        for d in differences(sides[UNFUSED], sides[side])
    ]


def reference_differences(name: str) -> list[str]:
    """Every rank's differences of verl's unfused path from the unsplit model (the rank's parameters only)."""
    return [
        f"rank {rank}: {d}"
        for rank, sides in enumerate(case_results(name))
        for d in differences(sides[REFERENCE], sides[UNFUSED], gradients_of_got_only=True)
    ]
