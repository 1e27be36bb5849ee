"""`top_k_kernel` alone at each warp count, on one chunk of kept logits (CUDA).

Why: the kernel's searches are chains of reductions, latency-bound on one warp, barrier-bound on many; which count
is fastest depends on how many values a row ranks at once (k x 16). This times the kernel (triton.testing.do_bench)
on `--rows` rows of random logits at the op's tile and group widths, at each k and warp count, after checking the
launch's result against a full sort; `top_k_warps` is the rule the op launches with.

    python3 scripts/sweep_top_k_warps.py --out results/sweep_top_k_warps_h100.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from verl_fused_hook.ops.backends import triton_kernels as kernels
from verl_fused_hook.ops.backends import triton_selected_tokens as selected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1536, help="rows of one chunk (default %(default)s: k=128, 1 GiB)")
    parser.add_argument("--columns", type=int, default=151936, help="the shard's columns (default %(default)s)")
    parser.add_argument("--topk", type=int, nargs="+", default=[128, 64, 32], help="k values (default 128 64 32)")
    parser.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8], help="warp counts (default 1 2 4 8)")
    parser.add_argument("--out", help="JSON file for the timings")
    args = parser.parse_args()
    rows, columns = args.rows, args.columns
    width, group = 256, selected.GROUP_COLUMNS
    g = torch.Generator(device="cuda").manual_seed(0)
    raw = torch.randn(rows, columns, device="cuda", generator=g) * 3
    tiles = -(-columns // width)
    padded = torch.cat([raw, raw.new_full((rows, tiles * width - columns), -1.0e30)], 1)  # the forward kernel's NEG
    kept = selected.KeptLogits(
        raw, padded.view(rows, tiles, width).amax(2), padded.view(rows, -1, group).amax(2), width, group
    )
    inv_temp = torch.rand(rows, device="cuda", generator=g) + 0.5
    report = {"device": torch.cuda.get_device_name(), "rows": rows, "columns": columns, "us": {}}
    for k in args.topk:
        values, ids, _ = selected.top_candidates(kept, inv_temp, k, 0)
        expected = torch.sort(raw, dim=1, descending=True, stable=True).indices[:, :k]
        exact = torch.equal(ids.sort(1).values, expected.sort(1).values)
        block_t, block_k = selected._selection_blocks(columns, width, k)
        scratch = torch.empty(rows, block_k, dtype=torch.int32, device="cuda")
        per_tile = width // group
        for warps in args.warps:

            def launch(warps=warps):
                kernels.top_k_kernel[(rows,)](
                    raw, raw.stride(0), None, None, 0, kept.tile_max, kept.tile_max.stride(0), kept.group_max,
                    kept.group_max.stride(0), inv_temp, scratch, values, ids, k, tiles, columns, k, 0,
                    GROUP=group, PER_TILE=per_tile, BLOCK_T=block_t, BLOCK_K=block_k, TOKENS_BLOCK=0,
                    num_warps=warps,
                )  # fmt: skip

            us = triton.testing.do_bench(launch, warmup=5, rep=50) * 1000
            report["us"][f"k={k} warps={warps}"] = us
            chosen = selected.top_k_warps(block_t, block_k, group, per_tile)
            print(f"k={k} warps={warps}: {us:.1f} us a chunk of {rows} rows (exact {exact}; the op's {chosen})")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
