"""Where `token_log_probs`' forward spends its time on the GPU: one call at the teacher's k ids with the row's own
top-k (the distillation bench's kl_topk forward), its kernels and host ops by device time (torch.profiler).

    python scripts/profile_token_log_probs.py --shape 16384,4096,151936 --topk 128 --out results/profile_kl_topk.json
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from verl_fused_hook.ops import token_log_probs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="16384,4096,151936", help="N,H,V (default %(default)s)")
    parser.add_argument("--topk", type=int, nargs="+", default=[128, 32], help="k values (default 128 32)")
    parser.add_argument("--rows", type=int, default=25, help="table rows printed per k (default %(default)s)")
    parser.add_argument("--out", help="JSON file for the tables")
    args = parser.parse_args()
    n, h, v = (int(x) for x in args.shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = (torch.randn(n, h, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) * h**-0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    report = {"shape": [n, h, v], "device": torch.cuda.get_device_name(), "torch": torch.__version__, "tables": {}}
    for k in args.topk:
        ids = torch.randint(0, v, (n, k), device="cuda", generator=g)

        def forward(ids=ids, k=k):
            return token_log_probs(
                hidden, weight, labels, ids, temperature=0.7, calculate_log_probs=False, calculate_entropy=False,
                top_k=k,
            )  # fmt: skip

        forward()  # compile and tune outside the profile
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        forward()
        stop.record()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            forward()
            torch.cuda.synchronize()
        rows = []
        for event in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[: args.rows]:
            rows.append(
                {
                    "name": event.key[:90],
                    "calls": event.count,
                    "self_device_ms": event.self_device_time_total / 1e3,
                }
            )
        report["tables"][str(k)] = {"forward_ms": start.elapsed_time(stop), "kernels": rows}
        print(f"k={k}: forward {start.elapsed_time(stop):.2f} ms (one call, timed outside the profile)")
        for row in rows:
            print(f"  {row['self_device_ms']:9.2f} ms  {row['calls']:5d}x  {row['name']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
