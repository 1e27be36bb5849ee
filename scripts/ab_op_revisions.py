"""The op at another git revision against the working tree's, timed in rounds on one GPU (CUDA).

Why: a kernel or dispatch change is judged by an A/B in rounds on the same warm card (the card's clock moves by
several percent between runs), and its batch invariance by a row's bits alone and inside a batch. The other
revision's `verl_fused_hook` is unpacked under a package name of its own, so both run in one process.

    python scripts/ab_op_revisions.py --base f29c1ef --new-options '{"batch_invariant": true}' \
        --out results/ab_batch_invariance.json

Where the checkout has no git history (a device machine gets the working tree only), make the base's archive here
and carry it: `mkdir -p build/ab && git archive f29c1ef verl_fused_hook > build/ab/f29c1ef.tar`, then
`--base f29c1ef --base-archive build/ab/f29c1ef.tar` (build/ is git-ignored: name it in the call's carry).

Each round times, in alternating order, the forward alone (no grad, the old-log-prob pass; median of 3 calls) and a
forward+backward; the JSON holds every timing, the medians and new/base ratios, per shape the largest
difference of 777 rows' log-probs and entropy alone against the same rows last in the whole batch, and each
revision's peak allocation in one forward+backward beyond what was allocated before it.

With `--topk K` the op is `token_log_probs` as top-k distillation calls it: K teacher ids a row (their log-probs
differentiated), the row's own top K and its entropy; the probe then covers every output (top ids: equal or not).

    python scripts/ab_op_revisions.py --base main --topk 128 --shapes "16384,4096,151936;65536,4096,151936" \
        --out results/ab_kl_topk.json
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STANDARD_SHAPES = (
    "8192,4096,151936;32768,4096,151936;16384,3584,152064;65536,2048,151936;16384,5120,152064;32768,8192,128256"
)
PROBE_ROWS = 777


def load_revision(revision: str, folder: Path, archive_path: Path | None = None):
    """`verl_fused_hook.ops` as of `revision` (from `git archive`, or the archive made of it at `archive_path`),
    imported as `verl_fused_hook_base.ops`."""
    if archive_path is None:
        command = ["git", "archive", revision, "verl_fused_hook"]
        archive = subprocess.run(command, cwd=ROOT, capture_output=True, check=True).stdout
    else:
        archive = archive_path.read_bytes()
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    (folder / "verl_fused_hook").rename(folder / "verl_fused_hook_base")
    sys.path.insert(0, str(folder))
    return importlib.import_module("verl_fused_hook_base.ops")


def elapsed_ms(fn, calls: int = 1) -> float:
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / calls


def _outputs(result) -> list[torch.Tensor]:
    """The op's outputs as tensors: (log-probs, entropy), or every field of a TokenLogProbs that is set."""
    fields = result._asdict().values() if hasattr(result, "_asdict") else result
    return [t for t in fields if t is not None]


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    return (a - b).abs().max().item() if a.numel() else 0.0


def measure(ops_by_name: dict, n: int, h: int, v: int, rounds: int, top_k: int = 0) -> dict:
    """`ops_by_name`: "base" and "new", each a `log_probs_and_entropy` (options bound), or with `top_k` each a
    `token_log_probs` given `top_k` teacher ids a row and asked for the row's own top_k."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    h_grad, w_grad = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ids = torch.randint(0, v, (n, top_k), device="cuda", generator=g) if top_k else None
    coefficients = torch.randn(n, top_k, device="cuda", generator=g) if top_k else None

    def call(ops, h_in, w_in, rows=slice(None)):
        if not top_k:
            return ops(h_in[rows], w_in, labels[rows], temperature=0.7, backend="triton")
        return ops(h_in[rows], w_in, labels[rows], ids[rows], temperature=0.7, top_k=top_k, backend="triton")

    def forward(ops):
        with torch.no_grad():
            call(ops, hidden, weight)

    def step(ops):
        h_grad.grad = w_grad.grad = None
        out = call(ops, h_grad, w_grad)
        if top_k:
            loss = (out.token_log_probs * coefficients).sum() + out.log_probs.sum() + 0.01 * out.entropy.sum()
        else:
            loss = out[0].sum() + 0.01 * out[1].sum()
        loss.backward()

    times = {f"{kind}_{name}": [] for kind in ("forward", "step") for name in ops_by_name}
    for ops in ops_by_name.values():  # compile and warm
        forward(ops)
        step(ops)
    names = list(ops_by_name)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[f"forward_{name}"].append(elapsed_ms(lambda: forward(ops_by_name[name]), 3))
            times[f"step_{name}"].append(elapsed_ms(lambda: step(ops_by_name[name])))
    median = {key: statistics.median(values) for key, values in times.items()}
    peak_gib = {}  # one forward+backward's peak allocation beyond what was allocated before it
    for name, ops in ops_by_name.items():
        h_grad.grad = w_grad.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step(ops)
        torch.cuda.synchronize()
        peak_gib[name] = (torch.cuda.max_memory_allocated() - before) / 2**30
    probe = {}
    rows = torch.cat([torch.arange(PROBE_ROWS, n, device="cuda"), torch.arange(PROBE_ROWS, device="cuda")])
    for name, ops in ops_by_name.items():
        with torch.no_grad():
            alone = _outputs(call(ops, hidden, weight, slice(0, PROBE_ROWS)))
            inside = _outputs(call(ops, hidden, weight, rows))
        probe[name] = max(_difference(a, b[-PROBE_ROWS:]) for a, b in zip(alone, inside))
    return {
        "times_ms": times,
        "median_ms": median,
        "forward_new_over_base": median["forward_new"] / median["forward_base"],
        "step_new_over_base": median["step_new"] / median["step_base"],
        "alone_vs_batch_max_abs": probe,
        "step_peak_gib": peak_gib,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="git revision of the op to compare against")
    parser.add_argument(
        "--base-archive",
        type=Path,
        help="`git archive BASE verl_fused_hook` saved to a file, for a checkout without git history",
    )
    parser.add_argument("--shapes", default=STANDARD_SHAPES, help="N,H,V;... (default: the six standard shapes)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--topk", type=int, default=0, help="K > 0: time token_log_probs with K teacher ids and the row's own top K"
    )
    parser.add_argument(
        "--new-options",
        type=json.loads,
        default={},
        help="keyword arguments of the working tree's op, as JSON (e.g. '{\"batch_invariant\": true}')",
    )
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the Triton backend)")
    import verl_fused_hook.ops as new_ops

    with tempfile.TemporaryDirectory() as folder:
        base = load_revision(args.base, Path(folder), args.base_archive)
        op = "token_log_probs" if args.topk else "log_probs_and_entropy"
        ops = {"base": getattr(base, op), "new": functools.partial(getattr(new_ops, op), **args.new_options)}
        report = {
            "op": op,
            "topk": args.topk,
            "base": args.base,
            "new_options": args.new_options,
            "rounds": args.rounds,
            "device": torch.cuda.get_device_name(),
            "shapes": {},
        }
        for shape in args.shapes.split(";"):
            n, h, v = (int(x) for x in shape.split(","))
            result = measure(ops, n, h, v, args.rounds, args.topk)
            report["shapes"][shape] = result
            m, probe = result["median_ms"], result["alone_vs_batch_max_abs"]
            print(
                f"{n}x{h}x{v}: forward {m['forward_base']:.2f} -> {m['forward_new']:.2f} ms "
                f"({result['forward_new_over_base']:.4f}x), forward+backward {m['step_base']:.2f} -> "
                f"{m['step_new']:.2f} ms ({result['step_new_over_base']:.4f}x); a row alone vs in the batch: "
                f"base {probe['base']:.1e}, new {probe['new']:.1e}; a step's peak beyond its start: "
                f"{result['step_peak_gib']['base']:.2f} -> {result['step_peak_gib']['new']:.2f} GiB",
                flush=True,
            )
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
