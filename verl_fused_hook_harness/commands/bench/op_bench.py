"""Benchmark per-token log-probs (+ entropy) over a vocab-sized output layer on one CUDA GPU.

Why: the fused kernel is only worth shipping if it sits near the cuBLAS floor
and below its peers in memory, measured the same way on the same card. This
times every method with CUDA events (warm-ups, median of repeats; the methods' forward+backward repeats in
rounds over the methods, timing.py, and their forward alone in rounds with one GEMM over the same rows, the
forward ratio's reference; with --back-to-back K each timing is K calls in a row, the GPU held at
its power cap as in a training step), records the
peak memory a method allocates beyond its inputs and returned gradients, the SM clock
and power while each method's steps run (clocks.py, NVML), checks
accuracy against fp64 on a smaller shape, and writes a markdown table, a JSON
file and a PNG plot.

Methods: triton (this package), triton_keep (the same keeping logits for the
backward within 4 GiB: keep_logits_bytes), triton_main_grad (the same adding d_weight into an fp32 main_grad,
as under megatron's DDP with gradient_accumulation_fusion), torch (the portable backend), naive (full
logits), verl (verl's Triton kernel, loaded from its file without `import verl`),
liger (Liger-Kernel FLCE: loss only) and cce (cut-cross-entropy: loss only)
when installed, and floor (the cuBLAS GEMMs of the same shapes: 4 GEMMs with
the backward's recompute, 3 without). fused_loss (the op with verl's ppo_loss
inside) and verl_loss (verl's kernel, then verl's ppo_loss) time the output
layer plus the policy loss (policy_loss.py; they need `import verl`). kl_topk (token_log_probs at the teacher's
--topk ids), verl_kl_topk (verl's megatron forward_kl_topk on full logits) and verl_kl_topk_chunked (its
use_chunked_topk path) time the output layer plus verl's forward_kl_topk; sum_pi_squared our log-probs, entropy
and sum pi^2 (distill.py). replay_* time sampling replay: given kept sets of 20, 64, 512 ids or shaped like top-p
sets, sets computed in the trainer, and full logits masked to the sets (replay.py).

    verl-fused-hook bench --out results/bench
    verl-fused-hook bench --shapes 8192,4096,151936 --methods triton,floor
    verl-fused-hook bench --shapes "$STANDARD" --methods floor,fused_loss,verl_loss
    verl-fused-hook bench --shapes "16384,4096,151936;65536,4096,151936" --topk 128 \
        --methods floor,kl_topk,verl_kl_topk,verl_kl_topk_chunked,sum_pi_squared
    verl-fused-hook bench --shapes "16384,4096,151936;131072,4096,151936" \
        --methods floor,replay_given_20,replay_given_64,replay_given_512,replay_given_mix,replay_trainer,\
replay_masked_logits
    verl-fused-hook bench --plot-only results/bench_every_peer.json --out docs/images/bench_every_peer.png  # redraw,
    no GPU
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from verl_fused_hook.ops.chunking import available_bytes

from ...support.arguments import known_names
from ...support.compare import max_abs
from ...support.reference import reference_log_probs_entropy, relative_error
from ...support.reports import device_name, write_json
from ...support.upstream_notices import UpstreamNotices, add_verbose_argument
from . import policy_loss
from .clocks import ClockMeter
from .held_memory import GIB, ChunkPlans, hold_memory
from .methods import ALL_METHODS, load_methods
from .report import markdown, plot
from .timing import settle_clocks, time_in_rounds, time_ms

STANDARD_SHAPES = "8192,4096,151936;32768,4096,151936;16384,3584,152064;65536,2048,151936"
# Long context, where a backward whose chunking depends on N shows a cliff (issue 16's table).
LONG_SHAPES = "32768,4096,248320;65536,4096,248320;131072,4096,248320;131072,4096,151936;131072,2048,151936"
DEFAULT_SHAPES = f"{STANDARD_SHAPES};{LONG_SHAPES}"
# The scaling sweep (--sweep): every N at each (H, V), ours and the floor only.
SWEEP_TOKENS = (4096, 16384, 65536, 131072, 262144)
SWEEP_WIDTHS = ((2048, 151936), (4096, 248320), (5120, 248320))
# The floor's GEMMs run on row chunks whose [rows, V] bf16 upstream gradient stays under this size.
FLOOR_CHUNK_BYTES = 8 * GIB


def _inputs(n, h, v, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp = torch.randn(n, device="cuda", generator=g)
    g_ent = torch.randn(n, device="cuda", generator=g)
    return hidden, weight, labels, g_lp, g_ent


def _fwd_bwd(fn, hidden, weight, labels, temperature, g_lp, g_ent, score_mask=None):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    if getattr(fn, "returns_loss", False):
        return torch.autograd.grad(fn(h, w, labels, temperature, score_mask), (h, w))
    lp, ent = fn(h, w, labels, temperature, score_mask)
    outputs, grads = [lp], [g_lp]
    if ent is not None:
        outputs.append(ent)
        grads.append(g_ent)
    return torch.autograd.grad(outputs, (h, w), grads)


def _floor_chunk_ms(hidden, weight, rows, warmup, repeats, calls) -> dict:
    """cuBLAS times of the forward GEMM (also the recompute), dX and dW of `rows` rows."""
    v = weight.shape[0]
    h_rows = hidden[:rows]
    logits = torch.empty(rows, v, dtype=hidden.dtype, device=hidden.device)
    d_hidden = torch.empty_like(h_rows)
    d_weight = torch.empty_like(weight)
    fwd = time_ms(lambda: torch.mm(h_rows, weight.t(), out=logits), warmup, repeats, calls)
    logits.normal_()
    dx = time_ms(lambda: torch.mm(logits, weight, out=d_hidden), warmup, repeats, calls)
    dw = time_ms(lambda: torch.mm(logits.t(), h_rows, out=d_weight), warmup, repeats, calls)
    return {"gemm_ms": fwd, "dx_ms": dx, "dw_ms": dw}


ONE_GEMM = "one GEMM"  # the forward-only rounds' reference step


def _forward_only(fn, hidden, weight, labels, temperature) -> None:
    with torch.no_grad():
        fn(hidden, weight, labels, temperature, None)


def _one_gemm(hidden: torch.Tensor, weight: torch.Tensor):
    """A step: hidden @ weight.T over every row, in the floor's row chunks (one [rows, V] buffer a call)."""
    n, v = hidden.shape[0], weight.shape[0]
    rows = floor_chunk_rows(hidden, weight)

    def run() -> None:
        logits = torch.empty(rows, v, dtype=hidden.dtype, device=hidden.device)
        for start in range(0, n, rows):
            part = hidden[start : start + rows]
            torch.mm(part, weight.t(), out=logits[: part.shape[0]])

    return run


def floor_chunk_bytes(weight: torch.Tensor) -> int:
    """FLOOR_CHUNK_BYTES, or less when the GPU is short of memory (--leave-free-gib): a third of what is free
    beside the timing's d_weight (what the fused loss counts as free: the driver's free memory and the caching
    allocator's unused blocks), so the floor never runs out of memory where the methods it measures fit."""
    free = available_bytes(weight.device) - weight.numel() * weight.element_size()
    return max(1, min(FLOOR_CHUNK_BYTES, free // 3))


def floor_chunk_rows(hidden: torch.Tensor, weight: torch.Tensor) -> int:
    """Rows of the floor's GEMMs at a time: as many as `floor_chunk_bytes` of [rows, V] logits hold."""
    return max(1, min(hidden.shape[0], floor_chunk_bytes(weight) // (hidden.element_size() * weight.shape[0])))


def floor_ms(hidden, weight, warmup, repeats, calls=1) -> dict:
    """cuBLAS floor of these shapes: one GEMM forward, 4 GEMMs forward+backward with recompute. Past
    `floor_chunk_bytes` of [N, V] logits the GEMMs are timed on row chunks and summed (the same FLOPs; a
    single-shot floor would need the whole [N, V] gradient in memory). `calls`: GEMMs back to back per timing."""
    n = hidden.shape[0]
    rows = floor_chunk_rows(hidden, weight)
    full, rest = divmod(n, rows)
    chunk = _floor_chunk_ms(hidden, weight, rows, warmup, repeats, calls)
    total = {key: full * value for key, value in chunk.items()}
    if rest:
        for key, value in _floor_chunk_ms(hidden, weight, rest, warmup, repeats, calls).items():
            total[key] += value
    torch.cuda.empty_cache()
    gradients_ms = total["dx_ms"] + total["dw_ms"]
    return {
        **total,
        "fwd_bwd_ms": 2 * total["gemm_ms"] + gradients_ms,
        "fwd_bwd_3gemm_ms": total["gemm_ms"] + gradients_ms,  # logits computed once (a fused loss)
        "chunk_rows": rows,
    }


def extra_memory_gib(fn, hidden, weight, labels, temperature, g_lp, g_ent) -> float:
    """Peak memory allocated during one forward+backward beyond inputs and returned gradients."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    grads = _fwd_bwd(fn, hidden, weight, labels, temperature, g_lp, g_ent)
    torch.cuda.synchronize()
    returned = sum(g.numel() * g.element_size() for g in grads)
    return (torch.cuda.max_memory_allocated() - base - returned) / GIB


def _guard(label: str, thunk: Callable[[], object]):
    """Run one measurement; an out-of-memory or a peer's refusal becomes a recorded failure."""
    try:
        return thunk()
    except (torch.OutOfMemoryError, AssertionError, RuntimeError, ValueError) as error:
        torch.cuda.empty_cache()
        if isinstance(
            error, torch.OutOfMemoryError
        ):  # torch's first sentences: what it tried to allocate, what was free
            reason = "out of memory: " + " ".join(str(error).split())[:400]
        else:
            reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        print(f"# {label}: {reason}", flush=True)
        return reason


def bench_shape(n, h, v, methods, args, plans: ChunkPlans | None = None, meter: ClockMeter | None = None) -> dict:
    """One shape's row; with `meter`, each method's and the floor's median SM clock and power while timed."""
    hidden, weight, labels, g_lp, g_ent = _inputs(n, h, v, seed=n)
    metered = meter.naming if meter else lambda name: contextlib.nullcontext()
    held = hold_memory(args.leave_free_gib)
    t = args.temperature
    row = {"N": n, "H": h, "V": v} | ({} if held is None else {"held_gib": held.numel() / GIB})
    if args.floor:
        with metered("floor"):
            floor_before = floor_ms(hidden, weight, args.warmup, args.repeats, args.back_to_back)
    method_plans = {name: [] for name in methods}  # the chunk plans each method's steps logged

    def collect(name):  # what was logged since the last collect was `name`'s
        if plans is not None:
            method_plans[name] += [line for line in plans.take() if line not in method_plans[name]]

    def step(name, fn):
        try:
            _fwd_bwd(fn, hidden, weight, labels, t, g_lp, g_ent)
        finally:  # a failed step's lines too
            collect(name)

    steps = {name: functools.partial(step, name, fn) for name, fn in methods.items()}
    fwd_bwd = time_in_rounds(
        steps,
        args.warmup,
        args.repeats,
        lambda name, thunk: _guard(f"{n},{h},{v} {name}", thunk),
        clock=meter.clock if meter else None,
        calls=args.back_to_back,
    )
    forward = {}
    if not args.quick:  # the forward alone, in rounds with one GEMM over the same rows (its own drift-free ratio)
        forward_steps = {
            name: functools.partial(_forward_only, fn, hidden, weight, labels, t) for name, fn in methods.items()
        }
        forward_steps[ONE_GEMM] = _one_gemm(hidden, weight)
        forward = time_in_rounds(
            forward_steps,
            args.warmup,
            args.repeats,
            lambda name, thunk: _guard(f"{n},{h},{v} {name} forward", thunk),
            clock=(lambda name, fn: meter.clock(name and f"{name} forward", fn)) if meter else None,
            calls=args.back_to_back,
        )
        row["one_gemm_in_rounds_ms"] = forward[ONE_GEMM]
        if meter:  # the clock while the forward rounds ran: a ratio to the GEMM is fair only at one clock
            row["one_gemm_in_rounds_clock"] = meter.take(f"{ONE_GEMM} forward")
    for name, fn in methods.items():
        label = f"{n},{h},{v} {name}"
        result = {"fwd_bwd_ms": fwd_bwd[name]} | (meter.take(name) if meter else {})
        if args.quick:
            if method_plans[name]:
                result["chunk_plans"] = method_plans[name]
            row[name] = result
            print(f"# {label} {result}", flush=True)
            continue
        if isinstance(result["fwd_bwd_ms"], float):
            result["extra_gib"] = _guard(label, lambda: extra_memory_gib(fn, hidden, weight, labels, t, g_lp, g_ent))
        result["fwd_ms"] = forward[name]
        if meter:
            result["fwd_clock"] = meter.take(f"{name} forward")
        if name in ("triton", "triton_keep", "triton_main_grad", "torch"):
            mask = torch.rand(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1)) < 0.5
            result["half_masked_fwd_bwd_ms"] = _guard(
                label,
                lambda: time_ms(
                    lambda: _fwd_bwd(fn, hidden, weight, labels, t, g_lp, g_ent, mask),
                    args.warmup,
                    args.repeats,
                    args.back_to_back,
                ),
            )
        collect(name)
        if method_plans[name]:
            result["chunk_plans"] = method_plans[name]
        row[name] = result
        print(f"# {label} {result}", flush=True)
    if args.floor:  # clocks drift under sustained load: the floor is the mean of before and after
        with metered("floor"):
            floor_after = floor_ms(hidden, weight, args.warmup, args.repeats, args.back_to_back)
        row["floor"] = {key: (floor_before[key] + floor_after[key]) / 2 for key in floor_before if key.endswith("_ms")}
        row["floor"] |= meter.take("floor") if meter else {}
        row["floor_runs"] = [floor_before, floor_after]
        print(f"# {n},{h},{v} floor before {floor_before} after {floor_after}", flush=True)
    return row


def accuracy(methods, n, h, v, temperature) -> dict:
    """Max abs error of log-probs/entropy and relative (Frobenius) error of both gradients vs fp64."""
    hidden, weight, labels, g_lp, g_ent = _inputs(n, h, v, seed=12345)
    out = {}
    references = {  # with entropy, and for the loss-only peers without (entropy's gradient weight 0)
        with_entropy: reference_log_probs_entropy(
            hidden,
            weight,
            labels,
            temperature=temperature,
            grad_outputs=(g_lp, g_ent if with_entropy else torch.zeros_like(g_ent)),
        )
        for with_entropy in (True, False)
    }
    torch.cuda.empty_cache()
    for name, fn in methods.items():
        check = getattr(fn, "accuracy", None)  # a method whose reference is not the plain log-probs' own
        if check is None and getattr(fn, "returns_loss", False):
            check = functools.partial(policy_loss.loss_accuracy, fn)
        if check is not None:
            out[name] = _guard(f"accuracy {name}", lambda: check(hidden, weight, labels, temperature))
            print(f"# accuracy {name} {out[name]}", flush=True)
            continue

        def measure():
            h = hidden.detach().requires_grad_()
            w = weight.detach().requires_grad_()
            if getattr(fn, "adds_to_main_grad", False):  # d_weight is what lands in a zeroed main_grad
                w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                w.grad_added_to_main_grad = False
            lp, ent = fn(h, w, labels, temperature, None)
            ref = references[ent is not None]
            outputs, grads = [lp], [g_lp]
            if ent is not None:
                outputs.append(ent)
                grads.append(g_ent)
            dh, dw = torch.autograd.grad(outputs, (h, w), grads)
            dw = getattr(w, "main_grad", dw)
            return {
                "log_prob_max_err": max_abs(ref[0], lp),
                "entropy_max_err": None if ent is None else max_abs(ref[1], ent),
                "d_hidden_rel_err": relative_error(dh, ref[2]),
                "d_weight_rel_err": relative_error(dw, ref[3]),
            }

        out[name] = _guard(f"accuracy {name}", measure)
        print(f"# accuracy {name} {out[name]}", flush=True)
    return out


# ---------------------------------------------------------------- reporting
def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    shapes = []
    for part in text.split(";"):
        values = tuple(int(x) for x in part.split(","))
        if len(values) != 3 or min(values) < 1:
            raise SystemExit(f"--shapes: expected N,H,V;N,H,V;..., got {part!r}")
        shapes.append(values)
    return shapes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shapes",
        default=DEFAULT_SHAPES,
        help="N,H,V;N,H,V;... (default: the four standard shapes and five long-context ones)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help=f"shapes: N in {SWEEP_TOKENS} at (H, V) in {SWEEP_WIDTHS} (replaces --shapes)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="forward+backward time only (no forward-only, masked or memory runs)"
    )
    parser.add_argument("--methods", default=",".join(ALL_METHODS), help=f"comma list of {', '.join(ALL_METHODS)}")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument(
        "--topk",
        type=int,
        default=128,
        help="the teacher's top-k of the distillation methods "
        "(kl_topk, verl_kl_topk, verl_kl_topk_chunked; verl's default 128)",
    )
    parser.add_argument(
        "--top-k-chunk-bytes",
        type=int,
        default=None,
        metavar="BYTES",
        help="kl_topk: token_log_probs' top_k_chunk_bytes, the memory for one chunk of rows (default: the op's, 1 GiB)",
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--back-to-back",
        type=int,
        default=1,
        metavar="K",
        help="each timing runs K calls with no wait between them and reports the time per call: the "
        "GPU held at its power cap, as inside a training step (default 1: one call per timing)",
    )
    parser.add_argument("--accuracy-shape", default="2048,4096,151936", help="N,H,V for the fp64 check ('' to skip)")
    parser.add_argument(
        "--verl-kernel-dir", default=None, help="folder with verl's kernels.py (default: installed verl)"
    )
    parser.add_argument(
        "--out",
        default="bench",
        help="output prefix: writes PREFIX.md, PREFIX.json, PREFIX.png "
        "(with --plot-only: the PNG, PREFIX or PREFIX.png)",
    )
    parser.add_argument(
        "--plot-only",
        metavar="JSON",
        default=None,
        help="no measuring (no GPU needed): redraw the plot of a finished run's JSON into --out and print its tables",
    )
    parser.add_argument(
        "--leave-free-gib",
        type=float,
        default=None,
        metavar="G",
        help="at each shape, once its inputs exist, hold all but G GiB of the GPU's free memory in "
        "another allocation while measuring (a job short of memory: the fused loss sizes its chunk "
        "from what is free; its chunk plans are recorded)",
    )
    add_verbose_argument(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.back_to_back < 1:
        parser.error(f"--back-to-back: must be >= 1, got {args.back_to_back}")
    if args.plot_only:
        return redraw(Path(args.plot_only), Path(args.out))
    if not torch.cuda.is_available():
        raise SystemExit("bench needs a CUDA device")
    args.methods = known_names(parser, "--methods", args.methods, ALL_METHODS)
    if args.top_k_chunk_bytes is not None and args.top_k_chunk_bytes < 1:
        parser.error(f"--top-k-chunk-bytes: must be an int >= 1, got {args.top_k_chunk_bytes}")
    if args.leave_free_gib is not None and args.leave_free_gib <= 0:
        parser.error(f"--leave-free-gib: must be > 0, got {args.leave_free_gib}")
    with UpstreamNotices(verbose=args.verbose):
        return measure(args, argv)


def redraw(json_path: Path, out: Path) -> int:
    """The plot of a finished run (its JSON) into OUT.png; its tables on stdout."""
    if not json_path.exists():
        raise SystemExit(f"--plot-only: {json_path} does not exist")
    results = json.loads(json_path.read_text())
    plot(results, out.with_suffix(".png"))
    print(markdown(results))
    print(f"plot: {out.with_suffix('.png')}")
    return 0


def measure(args, argv: list[str]) -> int:
    """Every method at every shape, the accuracy check, then OUT.json, OUT.md, OUT.png and the tables
    (with --leave-free-gib, another allocation holds the rest of the GPU at each shape, recorded)."""
    args.floor = "floor" in args.methods
    skipped: dict[str, str] = {}
    shapes = [(n, h, v) for h, v in SWEEP_WIDTHS for n in SWEEP_TOKENS] if args.sweep else parse_shapes(args.shapes)
    accuracy_shapes = parse_shapes(args.accuracy_shape) if args.accuracy_shape else []
    methods = load_methods(
        args.methods, args.verl_kernel_dir, skipped, shapes + accuracy_shapes, args.topk, args.top_k_chunk_bytes
    )
    results = {
        "device": device_name("cuda"),
        "torch": torch.__version__,
        "command": " ".join(["verl-fused-hook", "bench", *argv]),
        "temperature": args.temperature,
        "topk": args.topk,
        "top_k_chunk_bytes": args.top_k_chunk_bytes,
        "methods": (["floor"] if args.floor else []) + list(methods),
        "skipped": skipped,
        "leave_free_gib": args.leave_free_gib,
        "back_to_back": args.back_to_back,
        "shapes": [],
    }
    if args.accuracy_shape:
        results["accuracy_shape"] = accuracy_shapes[0]
        results["accuracy"] = accuracy(methods, *results["accuracy_shape"], args.temperature)
    meter, why_not = ClockMeter.open()
    if meter is None:
        results["clocks_not_recorded"] = why_not
        print(f"# SM clock and power not recorded: {why_not}", flush=True)
    else:
        results["power_reading"] = meter.power_source
    settle_clocks()
    try:
        with ChunkPlans() if args.leave_free_gib is not None else contextlib.nullcontext() as plans:
            for n, h, v in shapes:
                results["shapes"].append(bench_shape(n, h, v, methods, args, plans, meter))
                torch.cuda.empty_cache()
    finally:
        if meter is not None:
            meter.close()
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    table = markdown(results)
    write_json(results, prefix.with_suffix(".json"), indent=1)
    prefix.with_suffix(".md").write_text(table)
    plot(results, prefix.with_suffix(".png"))
    print(table)
    return 0


if __name__ == "__main__":
    main()
