"""Two checks of how the no-grad forward is timed against one GEMM (CUDA), written for issue 55's open question.

`state`: does what ran before (nothing, three calls back to back, the floor's GEMMs, six forward+backward calls)
change the op's time against one GEMM timed in the same rounds? Each state's rounds also record the SM clock of
each step (NVML) and both kernels' own time under the profiler.
`host`: where the host time of one no-grad call at 1024 x 4096 x 151936 goes, as wall-clock time per function
(GPU idle between calls, no profiler), the forward kernel's time, and the call's CUDA-event time.

    python3 scripts/forward_round_states.py OUT.json host state

(results/forward_round_states_h100.json is this command's output on an H100 at c49e172, whose functions were named
merged_splits for merge_tiles, with no forward_partials.)
"""

import contextlib
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


# The functions of one no-grad call whose wall time `host_breakdown` reads.
HOST_FUNCTIONS = {
    "two_pass": ("build_problem", "resolve_backend", "combine_row_statistics", "scatter_rows"),
    "triton_backend": (
        "_block", "local_statistics", "forward_partials", "merge_tiles", "descriptor", "split_layout",
        "label_columns", "inverse_temperature", "tma_ready",
    ),
}  # fmt: skip


@contextlib.contextmanager
def timing_functions(modules: dict, spent: dict):
    """HOST_FUNCTIONS wrapped to add their wall time (ns) to `spent` while the block runs, the originals back after:
    what they compute does not change."""
    originals = []
    for module_name, names in HOST_FUNCTIONS.items():
        module = modules[module_name]
        for name in names:
            original = getattr(module, name)
            originals.append((module, name, original))

            def wrapper(*args, _original=original, _key=f"{module_name}.{name}", **kwargs):
                start = time.perf_counter_ns()
                try:
                    return _original(*args, **kwargs)
                finally:
                    spent.setdefault(_key, []).append(time.perf_counter_ns() - start)

            setattr(module, name, wrapper)
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


def median_wall_us(call, repeats: int = 100) -> float:
    """Median host wall time of `call`, the GPU idle before each (synchronized after)."""
    walls = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        call()
        walls.append(time.perf_counter_ns() - start)
        torch.cuda.synchronize()
    return statistics.median(walls) / 1e3


def host_breakdown(out, n=1024, h=4096, v=151936):
    from verl_fused_hook.ops import log_probs_and_entropy, two_pass
    from verl_fused_hook.ops.backends import triton_backend

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
    out["host_wall_us_unwrapped"] = median_wall_us(call)
    spent = {}
    with timing_functions({"two_pass": two_pass, "triton_backend": triton_backend}, spent):
        out["host_wall_us_wrapped"] = median_wall_us(call)
    out["host_us"] = {k: statistics.median(v) / 1e3 for k, v in spent.items()}
    out["call_kernels_us"] = kernels(call)
    ev = []
    for _ in range(50):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        torch.cuda.synchronize()
        ev.append(a.elapsed_time(b) * 1e3)
    out["call_event_us"] = statistics.median(ev)
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
