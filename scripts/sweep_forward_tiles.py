"""The no-grad log-prob forward against one cuBLAS GEMM, per candidate tile config of the forward kernel (CUDA).

Why (issue 55): on an H100 the forward took 1.18-1.51x one GEMM where the H200 took 1.04-1.09x; before changing the
kernel or its launch, this measures which tiles, pipelining, grouping and split layouts move that ratio on the card
at hand, each candidate checked against the op's own log-probs. The op's no-grad path (two_pass.run_passes over the
Triton backend's one block of rows) runs with each candidate's tiles passed to the forward launcher
(`triton_backend.local_statistics`'s config and per_split); the op itself (the bench's triton forward, its
FORWARD_CONFIG) is timed beside them, with the GEMM, in rounds (harness timing.py: every step meets the same clock
drift). `--profile` also runs torch.profiler over one call of the op and of the GEMM at one shape: which kernels,
in what order, how long, and the GPU's idle gaps between them; and cProfile over the op's calls: where the host
spends the time the GPU waits for.

A candidate is written BMxBNxBKwWARPSsSTAGES, then optionally gGROUP_M (default 16), cCTAS_PER_SM (default 1: the
slots the split layout is modelled for) and pTILES_PER_SPLIT (default: the op's modelled layout for the row count):
128x256x64w8s3g16 is today's FORWARD_CONFIG.

    python3 scripts/sweep_forward_tiles.py --out results/sweep_forward_tiles.json --profile
    python3 scripts/sweep_forward_tiles.py --shapes "1024,4096,151936" \\
        --candidates 128x256x64w8s3g16,128x256x64w8s3g16p9,128x256x64w8s3g16p38
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from verl_fused_hook.ops.arguments import build_problem
from verl_fused_hook.ops.backends import triton_backend
from verl_fused_hook.ops.backends.forward_layout import tile_partial_rows
from verl_fused_hook.ops.backends.triton_backend import FORWARD_CONFIG, TileConfig
from verl_fused_hook.ops.softmax_math import combine_row_statistics, scatter_rows
from verl_fused_hook_harness.commands.bench.clocks import ClockMeter
from verl_fused_hook_harness.commands.bench.methods import ours
from verl_fused_hook_harness.commands.bench.op_bench import parse_shapes
from verl_fused_hook_harness.commands.bench.timing import event_ms, settle_clocks, time_in_rounds
from verl_fused_hook_harness.support.compare import max_abs
from verl_fused_hook_harness.support.reports import device_name, write_json

# Issue 55's shapes: the standard and long ones the H100 measured, then the small micro-batches.
ISSUE_SHAPES = (
    "24576,3584,152064;12288,5120,152064;49152,4096,128256;4096,4096,151936;2048,3584,152064;1024,4096,151936"
)
DEFAULT_CANDIDATES = (
    "128x256x64w8s3g16",  # today's FORWARD_CONFIG: the reference
    "128x256x64w8s4g16",  # one more stage in flight: latency of the weight's loads
    "128x256x32w8s4g16",
    "128x256x32w8s6g16",  # more, shallower stages: as many bytes in flight, finer
    "128x128x64w4s4g16",
    "128x128x64w8s3g16",
    "128x128x64w4s3g16c2",  # two programs an SM: one's softmax epilogue beside the other's GEMM
    "256x128x64w8s3g16",
    "128x256x64w8s3g8",
    "128x256x64w8s3g32",  # row blocks sharing the weight's tiles in L2
    "128x256x64w8s3g16p9",  # more, shorter splits (finer waves at small N, more partials to merge)
    "128x256x64w8s3g16p38",  # fewer, longer splits (one wave of 128 programs at N = 1024)
)
PROFILE_SHAPE = "1024,4096,151936"
TEMPERATURE = 0.7  # the bench's default
OP = "op (bench's triton forward)"
GEMM = "one GEMM"
# The GEMM also timed alone, calls back to back: at the card's power cap, as the floor's GEMMs run (the H200's
# figures in docs/ were read against those); in rounds between lighter steps it may start with headroom.
GEMM_ALONE = "one GEMM alone"
ALONE_CALLS = 3
_CANDIDATE = re.compile(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(?:g(\d+))?(?:c(\d+))?(?:p(\d+))?")


@dataclass(frozen=True)
class Candidate:
    """One forward launch to time: its tiles and pipelining, and column tiles per split (None: the op's model)."""

    config: TileConfig
    per_split: int | None = None

    @property
    def name(self) -> str:
        c = self.config
        name = f"{c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}g{c.group_m}"
        name += "" if c.ctas_per_sm == 1 else f"c{c.ctas_per_sm}"
        return name + ("" if self.per_split is None else f"p{self.per_split}")


def parse_candidate(text: str) -> Candidate:
    """A Candidate from its compact form (the module docstring); ValueError saying what is wrong."""
    match = _CANDIDATE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"{text!r}: expected BMxBNxBKwWARPSsSTAGES[gGROUP_M][cCTAS_PER_SM][pTILES_PER_SPLIT]")
    bm, bn, bk, warps, stages, group, ctas, per = (None if value is None else int(value) for value in match.groups())
    if any(size < 16 or size & (size - 1) for size in (bm, bn, bk)) or warps < 1 or warps & (warps - 1):
        raise ValueError(f"{text!r}: block sizes must be powers of two >= 16, warps a power of two")
    group = FORWARD_CONFIG.group_m if group is None else group
    ctas = 1 if ctas is None else ctas
    if min(stages, group, ctas, 1 if per is None else per) < 1:
        raise ValueError(f"{text!r}: stages, group_m, ctas_per_sm and tiles per split must be >= 1")
    return Candidate(TileConfig(bm, bn, bk, group, warps, stages, ctas), per)


def sweep_forward(hidden, weight, labels, temperature, candidate: Candidate):
    """fp32 (log_probs, entropy): the op's no-grad path over the Triton backend's one block, with the candidate's
    tiles and split layout."""
    with torch.no_grad():
        p = build_problem(
            hidden, weight, labels, temperature=temperature, tp_group=None, score_mask=None, ignore_index=-100,
            vocab_size=None, calculate_entropy=True, tile_rows=None,
        )  # fmt: skip
        passes = triton_backend.two_pass_passes(p)
        b = passes.block
        partials = triton_backend.local_statistics(
            p, b.hidden, passes.weight, b.label_col, b.inv_temp, config=candidate.config, per_split=candidate.per_split
        )
        statistics = combine_row_statistics(p, partials)
        return scatter_rows(p, statistics.log_probs), scatter_rows(p, statistics.entropy)


def layout(n: int, v: int, candidate: Candidate, sms: int) -> dict:
    """The candidate's first launch at N rows (a launch takes at most `tile_partial_rows` rows): its rows, tiles per
    split, splits, programs, and waves of programs over the SMs' slots; and how many launches the N rows take."""
    c = candidate.config
    col_tiles, slots = -(-v // c.block_n), sms * c.ctas_per_sm
    rows = min(n, tile_partial_rows(col_tiles, 4, c.block_m))
    row_blocks = -(-rows // c.block_m)
    per = candidate.per_split or triton_backend.tiles_per_split(col_tiles, slots, row_blocks)
    splits = -(-col_tiles // per)
    return {
        "launch_rows": rows,
        "launches": -(-n // rows),
        "per_split": per,
        "splits": splits,
        "programs": row_blocks * splits,
        "waves": row_blocks * splits / slots,
    }


def _inputs(n: int, h: int, v: int):
    """The bench's inputs at this shape (its seed: N)."""
    g = torch.Generator(device="cuda").manual_seed(n)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    return hidden, weight, torch.randint(0, v, (n,), device="cuda", generator=g)


def _failure(label: str, thunk):
    """The thunk's value, or the reason it failed (a config that does not fit, out of memory): a candidate's data."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    try:
        return thunk()
    except (CompilationError, OutOfResources, RuntimeError, ValueError) as error:
        torch.cuda.empty_cache()
        reason = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
        print(f"# {label}: {reason}", flush=True)
        return reason


def sweep_shape(n: int, h: int, v: int, candidates: list[Candidate], args, meter: ClockMeter | None) -> dict:
    """One shape: each candidate checked against the op's log-probs, then all timed in rounds with the op and the
    GEMM; with `meter`, each step's median SM clock and power while timed, and its cycles against the GEMM's."""
    hidden, weight, labels = _inputs(n, h, v)
    logits = torch.empty(n, v, dtype=hidden.dtype, device="cuda")
    op = ours("triton")

    def op_step():
        with torch.no_grad():
            return op(hidden, weight, labels, TEMPERATURE)

    reference = op_step()
    steps = {GEMM: lambda: torch.mm(hidden, weight.t(), out=logits), OP: op_step}
    clock = meter.clock if meter else None
    alone = time_in_rounds({GEMM_ALONE: steps[GEMM]}, args.warmup, args.repeats, _failure, clock, ALONE_CALLS)
    results = {GEMM: {}, GEMM_ALONE: {}, OP: {}}
    for candidate in candidates:

        def run(candidate=candidate):
            return sweep_forward(hidden, weight, labels, TEMPERATURE, candidate)

        checked = _failure(f"{n},{h},{v} {candidate.name}", run)  # compiles outside the timing
        if isinstance(checked, str):
            results[candidate.name] = {"failed": checked}
            continue
        results[candidate.name] = layout(n, v, candidate, triton_backend.num_sms(hidden.device)) | {
            "log_prob_max_abs": max_abs(checked[0], reference[0]),
            "entropy_max_abs": max_abs(checked[1], reference[1]),
        }
        steps[candidate.name] = run
    times = alone | time_in_rounds(steps, args.warmup, args.repeats, _failure, clock, args.calls)
    readings = {name: meter.take(name) if meter else {} for name in times}
    gemm, gemm_alone = times[GEMM], times[GEMM_ALONE]
    for name, ms in times.items():
        if not isinstance(ms, float):
            results[name]["failed"] = ms
            continue
        results[name] |= {"ms": ms, "ratio": _over(ms, gemm), "ratio_to_alone": _over(ms, gemm_alone)}
        results[name] |= readings[name]
        if "sm_clock_mhz" in readings[name] and "sm_clock_mhz" in readings[GEMM] and isinstance(gemm, float):
            results[name]["cycles_ratio"] = (
                ms * readings[name]["sm_clock_mhz"] / (gemm * readings[GEMM]["sm_clock_mhz"])
            )
    print(f"# {n},{h},{v}: {results}", flush=True)
    return {"N": n, "H": h, "V": v, "steps": results}


def _over(ms, reference) -> float | None:
    """ms / reference, None where either failed."""
    return ms / reference if isinstance(ms, float) and isinstance(reference, float) else None


def _gpu_timeline(prof) -> dict:
    """The profiled call's GPU kernels and copies in start order (offset from the first one's start, duration, idle
    gap before each), the time from the call's first host op to its first kernel (the GPU waiting on the host), and
    the time per kernel name."""
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    if not gpu:
        return {"kernels": [], "by_name": [], "host_lead_us": None, "span_us": 0.0, "busy_us": 0.0}
    first = previous_end = gpu[0].time_range.start
    kernels, by_name = [], {}
    for event in gpu:
        start, end = event.time_range.start, event.time_range.end
        kernels.append(
            {"name": event.name[:100], "start_us": start - first, "us": end - start,
             "gap_before_us": max(0.0, start - previous_end)}
        )  # fmt: skip
        previous_end = max(previous_end, end)
        calls, total = by_name.get(event.name[:100], (0, 0.0))
        by_name[event.name[:100]] = (calls + 1, total + end - start)
    return {
        "kernels": kernels,
        "by_name": [{"name": k, "calls": c, "us": t} for k, (c, t) in sorted(by_name.items(), key=lambda i: -i[1][1])],
        "host_lead_us": first - host[0].time_range.start if host else None,
        "span_us": previous_end - first,
        "busy_us": sum(k["us"] for k in kernels),
    }


def profile_one_call(label: str, fn, rows: int) -> dict:
    """One call of `fn` under torch.profiler (compiled and timed once outside it first): its GPU timeline, how much
    of it the GPU was busy, and how long the host took to start it."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    call_ms = event_ms(fn)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    t = _gpu_timeline(prof) | {"call_ms": call_ms}
    lead = "-" if t["host_lead_us"] is None else f"{t['host_lead_us']:.0f} us"
    print(
        f"\n### profile: {label}: one call {call_ms:.3f} ms (CUDA events, outside the profile); "
        f"{len(t['kernels'])} GPU kernels/copies spanning {t['span_us'] / 1e3:.3f} ms, busy {t['busy_us'] / 1e3:.3f} "
        f"ms; first kernel {lead} after the call's first host op\n\n| us | calls | kernel |\n|---:|---:|---|"
    )
    for k in t["by_name"][:rows]:
        print(f"| {k['us']:.1f} | {k['calls']} | {k['name']} |")
    print("\n| start us | us | gap before us | kernel (in order) |\n|---:|---:|---:|---|")
    for k in t["kernels"][:rows]:
        print(f"| {k['start_us']:.1f} | {k['us']:.1f} | {k['gap_before_us']:.1f} | {k['name']} |")
    return t


def host_profile(fn, rows: int, calls: int = 50) -> dict:
    """Where the host spends a call of `fn` (the GPU idle before its kernel at small N): the median host time of a
    call (from its start to its return, the GPU drained before each) and cProfile's functions by own time."""
    import cProfile
    import pstats

    host_ms = []
    for _ in range(calls):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        host_ms.append((time.perf_counter() - start) * 1e3)
    profiler = cProfile.Profile()
    for _ in range(calls):
        torch.cuda.synchronize()
        profiler.enable()
        fn()
        profiler.disable()
    stats = pstats.Stats(profiler)
    top = sorted(stats.stats.items(), key=lambda item: -item[1][2])[:rows]  # (file, line, name) -> (cc, nc, tt, ct)
    functions = [
        {"function": f"{Path(file).name}:{line}:{name}", "calls": nc / calls, "own_us": tt / calls * 1e6,
         "cumulative_us": ct / calls * 1e6}
        for (file, line, name), (_, nc, tt, ct, _) in top
    ]  # fmt: skip
    median = sorted(host_ms)[len(host_ms) // 2]
    print(f"\n### host: median {median:.3f} ms a call (start to return); per call, by own time\n")
    print("| own us | cumulative us | calls | function |\n|---:|---:|---:|---|")
    for f in functions:
        print(f"| {f['own_us']:.1f} | {f['cumulative_us']:.1f} | {f['calls']:.0f} | {f['function']} |")
    return {"host_ms_median": median, "functions": functions}


def profile_shape(n: int, h: int, v: int, rows: int) -> dict:
    """The op's no-grad forward (the bench's) and the GEMM at one shape, each one call under the profiler."""
    hidden, weight, labels = _inputs(n, h, v)
    logits = torch.empty(n, v, dtype=hidden.dtype, device="cuda")
    op = ours("triton")

    def op_call():
        with torch.no_grad():
            op(hidden, weight, labels, TEMPERATURE)

    return {
        "shape": [n, h, v],
        OP: profile_one_call(f"{OP} at {n},{h},{v}", op_call, rows) | {"host": host_profile(op_call, rows)},
        GEMM: profile_one_call(f"{GEMM} at {n},{h},{v}", lambda: torch.mm(hidden, weight.t(), out=logits), rows),
    }


def markdown(report: dict) -> str:
    """The sweep's tables, titled with the card: the ratio to one GEMM per candidate and shape, then each shape's
    detail (ms, SM clock and power, cycles against the GEMM's, split layout, largest difference to the op's
    log-probs and entropy)."""
    shapes = report["shapes"]
    head = [f"{s['N']},{s['H']},{s['V']}" for s in shapes]
    lines = [
        f"## No-grad forward / one cuBLAS GEMM on {report['device']} ({report['sms']} SMs; torch {report['torch']}, "
        f"Triton {report['triton']}; median of {report['repeats']}, {report['calls']} call(s) a timing)",
        "",
        "| step | " + " | ".join(head) + " |",
        "|---|" + "---:|" * len(head),
    ]
    for name in [OP, *report["candidates"]]:
        cells = [_ratio(s["steps"].get(name, {}).get("ratio")) for s in shapes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cells = [_ratio(s["steps"].get(OP, {}).get("ratio_to_alone")) for s in shapes]
    lines += [
        f"| {OP} / {GEMM_ALONE} ({ALONE_CALLS} back to back, at the power cap) | " + " | ".join(cells) + " |",
    ]
    for s in shapes:
        lines += [
            "",
            f"### {s['N']},{s['H']},{s['V']} on {report['device']}",
            "",
            "| step | ms | / GEMM | MHz, W | cycles / GEMM's | tiles per split x splits | programs (waves) | "
            "max abs d log-prob | max abs d entropy |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, r in s["steps"].items():
            if "ms" not in r:
                lines.append(f"| {name} | failed: {r.get('failed', '')[:80]} | | | | | | | |")
                continue
            power = f"{r['sm_clock_mhz']:.0f}, {r['power_w']:.0f}" if "sm_clock_mhz" in r else "-"
            split = f"{r['per_split']} x {r['splits']}" if "per_split" in r else "-"
            programs = f"{r['programs']} ({r['waves']:.2f})" if "programs" in r else "-"
            diffs = [f"{r[key]:.2e}" if key in r else "-" for key in ("log_prob_max_abs", "entropy_max_abs")]
            lines.append(
                f"| {name} | {r['ms']:.3f} | {_ratio(r['ratio'])} | {power} | {_ratio(r.get('cycles_ratio'))} | "
                f"{split} | {programs} | {diffs[0]} | {diffs[1]} |"
            )
    return "\n".join(lines) + "\n"


def _ratio(value) -> str:
    return f"{value:.3f}x" if isinstance(value, float) else "-"


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=ISSUE_SHAPES, help="N,H,V;N,H,V;... ('' for none; default: issue 55's)")
    parser.add_argument(
        "--candidates",
        default=",".join(DEFAULT_CANDIDATES),
        help="comma list of candidates, BMxBNxBKwWARPSsSTAGES[gGROUP_M][cCTAS_PER_SM][pTILES_PER_SPLIT] "
        "(default: %(default)s)",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calls", type=int, default=1, help="calls back to back per timing (bench's --back-to-back)")
    parser.add_argument("--settle-seconds", type=float, default=5.0, help="GEMMs run first to settle the clocks")
    parser.add_argument("--profile", action="store_true", help="also profile one call of the op and of the GEMM")
    parser.add_argument("--profile-shape", default=PROFILE_SHAPE, help="N,H,V of --profile (default %(default)s)")
    parser.add_argument("--profile-rows", type=int, default=40, help="kernels listed per profiled call")
    parser.add_argument("--out", default=None, help="JSON path (and its .md beside it)")
    args = parser.parse_args(argv)
    try:
        args.candidates = [parse_candidate(text) for text in args.candidates.split(",") if text.strip()]
    except ValueError as error:
        parser.error(f"--candidates: {error}")
    if not args.candidates:
        parser.error("--candidates: none given")
    args.shapes = parse_shapes(args.shapes) if args.shapes.strip() else []
    (args.profile_shape,) = parse_shapes(args.profile_shape)
    if min(args.warmup + 1, args.repeats, args.calls, args.profile_rows) < 1:
        parser.error("--warmup must be >= 0; --repeats, --calls and --profile-rows >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        raise SystemExit("sweep_forward_tiles needs a CUDA device")
    import triton

    began = time.monotonic()
    report = {
        "device": device_name("cuda"),
        "sms": triton_backend.num_sms(torch.device("cuda")),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join(["python3", "scripts/sweep_forward_tiles.py", *(sys.argv[1:] if argv is None else argv)]),
        "temperature": TEMPERATURE,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "calls": args.calls,
        "candidates": [c.name for c in args.candidates],
        "shapes": [],
    }
    settle_clocks(args.settle_seconds)
    if args.profile:
        report["profile"] = profile_shape(*args.profile_shape, args.profile_rows)
        torch.cuda.empty_cache()
    meter, report["clocks_not_recorded"] = ClockMeter.open() if args.shapes else (None, "no shapes")
    report["power_reading"] = meter.power_source if meter is not None else None
    try:
        for n, h, v in args.shapes:
            report["shapes"].append(sweep_shape(n, h, v, args.candidates, args, meter))
            torch.cuda.empty_cache()  # the shape's inputs and [N, V] logits are gone with its frame
    finally:
        if meter is not None:
            meter.close()
    report["seconds"] = time.monotonic() - began
    table = markdown(report) if report["shapes"] else ""
    print(table + f"\n{report['seconds']:.0f} s in all on {report['device']}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json(report, out, indent=1)
        out.with_suffix(".md").write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
