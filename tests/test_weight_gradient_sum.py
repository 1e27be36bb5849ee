"""WeightGradientSum (the one d_weight accumulation every backend adds into), on the CPU against fp64: one product,
several products, and several blocks that each add their share chunk by chunk (the Triton backward's row groups)."""

from __future__ import annotations

import torch

from verl_fused_hook.ops.weight_gradient import WeightGradientSum

ROUNDING = 2.0**-8  # one bf16 rounding, relative to the element (half an ulp is 2^-9)


def _products(blocks: int, rows: int, v: int, h: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, v, generator=g), torch.randn(rows, h, generator=g)) for _ in range(blocks)]


def _exact(products) -> torch.Tensor:
    return sum(a.double().t() @ b.double() for a, b in products)


def _within_one_rounding(result: torch.Tensor, exact: torch.Tensor) -> bool:
    return bool(((result.double() - exact).abs() <= ROUNDING * exact.abs() + 1e-12).all())


def test_blocks_adding_chunk_by_chunk_round_once_over_a_reused_buffer():
    """Three blocks of rows, each walking five column chunks (the last narrower) in two row tiles: every share is
    added in fp32 over the earlier blocks' (the first block's overwrites a buffer full of NaN), rounded once."""
    v, h = 37, 8
    products = _products(3, 10, v, h, seed=1)
    target = torch.empty(v, h, dtype=torch.bfloat16)
    total = WeightGradientSum(target, len(products), buffer=torch.full((v, h), float("nan")))
    for a, b in products:
        for start in range(0, v, 8):
            stop = min(start + 8, v)
            share = total.columns(start, stop, 2)
            share.add(a[:6, start:stop], b[:6])
            share.add(a[6:, start:stop], b[6:])
            share.finish()
    total.finish()
    assert _within_one_rounding(target, _exact(products))


def test_one_block_chunk_by_chunk_and_several_products_whole():
    v, h = 29, 8
    one = _products(1, 12, v, h, seed=2)
    target = torch.empty(v, h, dtype=torch.bfloat16)
    total = WeightGradientSum(target, 1)
    for start in range(0, v, 16):
        share = total.columns(start, min(start + 16, v), 2, torch.empty(min(16, v - start), h))
        share.add(one[0][0][:5, start : start + 16], one[0][1][:5])
        share.add(one[0][0][5:, start : start + 16], one[0][1][5:])
        share.finish()
    total.finish()
    assert _within_one_rounding(target, _exact(one))

    several = _products(4, 6, v, h, seed=3)
    target = torch.empty(v, h, dtype=torch.bfloat16)
    total = WeightGradientSum(target, len(several))
    for a, b in several:
        total.add(a, b)
    total.finish()
    assert _within_one_rounding(target, _exact(several))


def test_a_sum_without_products_is_zero():
    target = torch.full((5, 3), 7.0, dtype=torch.bfloat16)
    WeightGradientSum(target, 2).finish()
    assert bool((target == 0).all())
