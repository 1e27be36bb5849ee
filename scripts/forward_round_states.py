"""Two checks of how the no-grad forward is timed against one GEMM (CUDA), written for issue 55's open question.

`state`: does what ran before (nothing, three calls back to back, the floor's GEMMs, six forward+backward calls)
change the op's time against one GEMM timed in the same rounds? Each state's rounds also record the SM clock of
each step (NVML) and both kernels' own time under the profiler.
`host`: where the host time of one no-grad call at 1024 x 4096 x 151936 goes, as wall-clock time of the call and of
its stages called one by one (GPU idle between calls, no profiler), the forward kernel's time, and the call's
CUDA-event time.

    python3 scripts/forward_round_states.py OUT.json host state

(results/forward_round_states_h100.json is this command's output on an H100 at c49e172, whose `host` mode timed the
same functions by wrapping them inside the call; that replaced module attributes, so the stages are now called in
turn instead.)
"""

import functools
import json
import statistics
import sys
import time

import torch


def guard(name, thunk):
    return thunk()


def kernels(fn):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key[:40]: round(e.device_time_total, 1) for e in prof.key_averages() if e.device_time_total > 20}


def state_experiment(out):
    from verl_fused_hook_harness.commands.bench.clocks import ClockMeter
    from verl_fused_hook_harness.commands.bench.methods import ours
    from verl_fused_hook_harness.commands.bench.op_bench import _forward_only, _fwd_bwd, _inputs, _one_gemm, floor_ms
    from verl_fused_hook_harness.commands.bench.timing import settle_clocks, time_in_rounds

    meter, why = ClockMeter.open()
    settle_clocks(5)
    op = ours("triton")
    for n, h, v in [(24576, 3584, 152064), (12288, 5120, 152064)]:
        hidden, weight, labels, g_lp, g_ent = _inputs(n, h, v, seed=n)
        steps = {
            "op": functools.partial(_forward_only, op, hidden, weight, labels, 0.7),
            "gemm": _one_gemm(hidden, weight),
        }
        shape = out.setdefault(f"{n},{h},{v}", {})

        def rounds(tag, calls=1):
            times = time_in_rounds(
                {f"{tag} {k}": s for k, s in steps.items()},
                1,
                7,
                guard,
                clock=meter.clock if meter else None,
                calls=calls,
            )
            row = {k: (round(t, 3), meter.take(k).get("sm_clock_mhz") if meter else None) for k, t in times.items()}
            row["ratio"] = times[f"{tag} op"] / times[f"{tag} gemm"]
            row["kernels_us"] = kernels(steps["op"])
            row["gemm_kernels_us"] = kernels(steps["gemm"])
            shape[tag] = row
            print(n, tag, row, flush=True)

        rounds("A fresh")
        rounds("A2 fresh, 3 back to back", calls=3)
        floor_ms(hidden, weight, 1, 5)
        rounds("B after floor")
        for _ in range(6):
            _fwd_bwd(op, hidden, weight, labels, 0.7, g_lp, g_ent)
        torch.cuda.synchronize()
        rounds("C after fwd_bwd")
        del hidden, weight, labels, g_lp, g_ent
        torch.cuda.empty_cache()
    if meter:
        meter.close()


def median_wall_us(call, repeats: int = 100) -> float:
    """Median host wall time of `call` in us, the GPU idle before each (synchronized after)."""
    walls = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        call()
        walls.append(time.perf_counter_ns() - start)
        torch.cuda.synchronize()
    return statistics.median(walls) / 1e3


def host_breakdown(out, n=1024, h=4096, v=151936):
    """The no-grad call's host time, whole, and stage by stage: its stages called in the op's order (as
    scripts/sweep_forward_tiles.py's sweep_forward calls them), each timed on its own."""
    from verl_fused_hook.ops import log_probs_and_entropy
    from verl_fused_hook.ops.arguments import build_problem
    from verl_fused_hook.ops.backends import resolve_backend, triton_backend
    from verl_fused_hook.ops.softmax_math import combine_row_statistics, scatter_rows
    from verl_fused_hook_harness.commands.bench.timing import event_ms

    g = torch.Generator(device="cuda").manual_seed(n)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)

    def call():
        with torch.no_grad():
            return log_probs_and_entropy(hidden, weight, labels, temperature=0.7, backend="triton")

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    out["host_wall_us"] = median_wall_us(call)
    stages = {}

    def timed(name, fn, *args, **kwargs):
        start = time.perf_counter_ns()
        value = fn(*args, **kwargs)
        stages.setdefault(name, []).append(time.perf_counter_ns() - start)
        return value

    def staged_call():
        with torch.no_grad():
            p = timed(
                "build_problem", build_problem, hidden, weight, labels, temperature=0.7, tp_group=None,
                score_mask=None, ignore_index=-100, vocab_size=None, calculate_entropy=True, tile_rows=None,
            )  # fmt: skip
            timed("resolve_backend", resolve_backend, "triton", p)
            passes = timed("two_pass_passes", triton_backend.two_pass_passes, p)
            b = passes.block
            args = (p, b.hidden, passes.weight, b.label_col, b.inv_temp)
            partials = timed("local_statistics", triton_backend.local_statistics, *args)
            statistics_ = timed("combine_row_statistics", combine_row_statistics, p, partials)
            timed(
                "scatter_rows", lambda: (scatter_rows(p, statistics_.log_probs), scatter_rows(p, statistics_.entropy))
            )

    median_wall_us(staged_call)
    out["host_us"] = {name: statistics.median(ns) / 1e3 for name, ns in stages.items()}
    out["call_kernels_us"] = kernels(call)
    out["call_event_us"] = statistics.median(event_ms(call) for _ in range(50)) * 1e3
    print(json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    result = {}
    if len(sys.argv) < 3 or not set(sys.argv[2:]) <= {"host", "state"}:
        raise SystemExit("usage: forward_round_states.py OUT.json host|state [host|state]")
    if "host" in sys.argv[2:]:
        host_breakdown(result.setdefault("host_1024", {}))
    if "state" in sys.argv[2:]:
        state_experiment(result.setdefault("state", {}))
    json.dump(result, open(sys.argv[1], "w"), indent=1)
