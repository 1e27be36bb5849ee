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


def test_accumulating_into_an_fp32_target_needs_no_buffer():
    """`accumulate` (megatron's fp32 main_grad): one product, several, and several blocks walking column chunks all
    add onto what the target held, in place; a sum that got no product leaves it as it was."""
    v, h = 29, 8
    before = torch.randn(v, h, generator=torch.Generator().manual_seed(5))
    for blocks, chunked in ((1, False), (4, False), (3, True)):
        products = _products(blocks, 7, v, h, seed=10 + blocks)
        target = before.clone()
        total = WeightGradientSum(target, len(products), accumulate=True)
        assert total.total is target
        for a, b in products:
            if not chunked:
                total.add(a, b)
                continue
            for start in range(0, v, 8):
                share = total.columns(start, min(start + 8, v), 2)
                assert share.total.data_ptr() == target[start:].data_ptr()
                share.add(a[:3, start : start + 8], b[:3])
                share.add(a[3:, start : start + 8], b[3:])
                share.finish()
        total.finish()
        exact = before.double() + _exact(products)
        assert (target.double() - exact).abs().max().item() <= 1e-5 * exact.abs().max().item()
    untouched = before.clone()
    WeightGradientSum(untouched, 2, accumulate=True).finish()
    assert torch.equal(untouched, before)


def test_accumulating_into_a_16_bit_target_rounds_once():
    """A bf16 target (a bf16 main_grad): several products summed in an fp32 buffer (NaN-filled: the first product
    overwrites it), then added onto the target in one rounding; one product adds straight into it."""
    v, h = 37, 8
    before = torch.randn(v, h, generator=torch.Generator().manual_seed(6)).bfloat16()
    for blocks in (1, 3):
        products = _products(blocks, 10, v, h, seed=20 + blocks)
        target = before.clone()
        total = WeightGradientSum(target, blocks, buffer=torch.full((v, h), float("nan")), accumulate=True)
        for a, b in products:
            total.add(a, b)
        total.finish()
        assert _within_one_rounding(target, before.double() + _exact(products))
