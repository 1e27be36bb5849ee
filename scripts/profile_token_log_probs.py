"""Where the op's step spends its time on the GPU: the distillation bench's methods (kl_topk at each k: our
`token_log_probs` at the teacher's ids with the row's own top-k, verl's loss and overlap metrics; sum_pi_squared:
the baseline without ids) and, with --log-probs, the plain log-probs and entropy op (the bench's `triton`), their
forward and, with --backward, their backward, kernels and host ops by device time (torch.profiler). Each step is
also timed once outside the profile.

    python scripts/profile_token_log_probs.py --shape 16384,4096,151936 --topk 128 --out results/profile_kl_topk.json
    python scripts/profile_token_log_probs.py --shape 65536,4096,151936 --topk 128 --backward --sum-pi-squared
    python scripts/profile_token_log_probs.py --shape 1024,4096,151936 --topk --log-probs --backward
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from verl_fused_hook_harness.commands.bench.distill import ours_kl_topk, ours_sum_pi_squared
from verl_fused_hook_harness.commands.bench.methods import ours
from verl_fused_hook_harness.commands.bench.timing import event_ms

TEMPERATURE = 0.7  # the bench's default


def _kernels(step, rows: int) -> list[dict]:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:rows]
    return [
        {"name": e.key[:90], "calls": e.count, "self_device_ms": e.self_device_time_total / 1e3}
        for e in events
        if e.self_device_time_total > 0
    ]


def _step_report(label: str, ms: float, kernels: list[dict]) -> dict:
    print(f"{label}: {ms:.2f} ms (one call, timed outside the profile)")
    for row in kernels:
        print(f"  {row['self_device_ms']:9.2f} ms  {row['calls']:5d}x  {row['name']}")
    return {"ms": ms, "kernels": kernels}


def profile_method(name: str, fn, inputs, backward: bool, rows: int) -> dict:
    """The method's forward (its loss, or the sum of its outputs) and, when asked, the backward of that loss alone
    (each on a graph built just before it): each run once outside the profile, then timed once, then profiled once."""
    hidden, weight, labels = inputs

    def forward():
        out = fn(hidden, weight, labels, TEMPERATURE)
        return out if getattr(fn, "returns_loss", False) else sum(t.float().sum() for t in out)

    def gradients(loss):
        return lambda: torch.autograd.grad(loss, (hidden, weight))

    with torch.enable_grad() if backward else torch.no_grad():
        forward()  # compile and tune outside the profile
        torch.cuda.synchronize()
        report = {"forward": _step_report(f"{name} forward", event_ms(forward), _kernels(forward, rows))}
        if backward:
            gradients(forward())()
            ms = event_ms(gradients(forward()))  # the stream runs the forward before the start event
            loss = forward()
            torch.cuda.synchronize()
            report["backward"] = _step_report(f"{name} backward", ms, _kernels(gradients(loss), rows))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="16384,4096,151936", help="N,H,V (default %(default)s)")
    parser.add_argument(
        "--topk", type=int, nargs="*", default=[128, 32], help="k values (default 128 32; none: no kl_topk)"
    )
    parser.add_argument("--backward", action="store_true", help="also profile each method's backward")
    parser.add_argument("--sum-pi-squared", action="store_true", help="also profile sum_pi_squared (the baseline)")
    parser.add_argument("--log-probs", action="store_true", help="also profile the plain log-probs and entropy op")
    parser.add_argument("--rows", type=int, default=25, help="table rows printed per step (default %(default)s)")
    parser.add_argument("--out", help="JSON file for the tables")
    args = parser.parse_args()
    n, h, v = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_(args.backward)
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).bfloat16().requires_grad_(args.backward)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    methods = {f"kl_topk k={k}": ours_kl_topk(k) for k in args.topk}
    if args.sum_pi_squared:
        methods["sum_pi_squared"] = ours_sum_pi_squared()
    if args.log_probs:
        methods["log_probs"] = ours("auto")
    report = {"shape": [n, h, v], "device": torch.cuda.get_device_name(), "torch": torch.__version__, "methods": {}}
    for name, fn in methods.items():
        report["methods"][name] = profile_method(name, fn, (hidden, weight, labels), args.backward, args.rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
