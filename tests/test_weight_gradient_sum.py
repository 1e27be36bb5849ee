"""WeightGradientSum (the one d_weight accumulation every backend adds into), on the CPU against fp64: one product,
several products, and several blocks that each add their share chunk by chunk (the Triton backward's row groups);
InputGradients (the two-pass backwards' returned gradients): padding, nothing flowing back, main_grad's placeholder."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from verl_fused_hook.ops.weight_gradient import InputGradients, WeightGradientSum

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


def _garbage_filled(grads: InputGradients) -> InputGradients:
    """The empty d_weight's valid columns made NaN, as uninitialized memory may hold: only the padding is zeroed."""
    grads.weight[: grads.valid_columns].fill_(float("nan"))
    return grads


def test_input_gradients_of_some_rows_and_the_padding():
    """Two blocks of scored rows (rows 1 and 3 of 5 are nobody's): d_hidden index-copied and rounded once to bf16,
    the rest zero; d_weight the fp32 sum of both blocks' products rounded once, its padding columns (5 of 12)
    zero however the memory was filled."""
    h, valid, padded = 4, 7, 12
    grads = _garbage_filled(
        InputGradients((True, True), ((5, h), torch.bfloat16), ((padded, h), torch.bfloat16), valid, 3, None, "cpu")
    )
    assert not grads.every_row_scored
    products = _products(2, 2, valid, h, seed=5)
    grads.start(len(products))
    g = torch.Generator().manual_seed(6)
    hidden_parts = [torch.randn(2, h, generator=g), torch.randn(1, h, generator=g)]
    for rows, d_hidden, (a, b) in zip(([0, 2], [4]), hidden_parts, products, strict=False):
        grads.weight_sum.add(a.bfloat16().float(), b.bfloat16().float())  # fp32 operands, as on the CPU
        grads.store_hidden(SimpleNamespace(rows=torch.tensor(rows), span=None), d_hidden)
    grads.store_hidden(SimpleNamespace(rows=torch.tensor([4]), span=None), None)  # a block without d_hidden
    d_hidden, d_weight = grads.finish()
    exact = _exact([(a.bfloat16().float(), b.bfloat16().float()) for a, b in products])
    assert _within_one_rounding(d_weight[:valid], exact)
    assert torch.equal(d_weight[valid:], torch.zeros(padded - valid, h, dtype=torch.bfloat16))
    assert torch.equal(d_hidden[[0, 2]], hidden_parts[0].bfloat16())
    assert torch.equal(d_hidden[4], hidden_parts[1][0].bfloat16())
    assert torch.equal(d_hidden[[1, 3]], torch.zeros(2, h, dtype=torch.bfloat16))


def test_input_gradients_of_every_row_go_by_span():
    grads = InputGradients((True, False), ((6, 3), torch.float32), ((4, 3), torch.float32), 4, 6, None, "cpu")
    assert grads.every_row_scored and grads.weight is None
    grads.start(2)
    assert grads.weight_sum is None  # no d_weight wanted, none summed
    parts = torch.randn(6, 3)
    grads.store_hidden(SimpleNamespace(rows=None, span=slice(0, 4)), parts[:4])
    grads.store_hidden(SimpleNamespace(rows=None, span=slice(4, 6)), parts[4:])
    d_hidden, d_weight = grads.finish()
    assert torch.equal(d_hidden, parts) and d_weight is None


def test_input_gradients_when_nothing_flows_back():
    """No block (no valid column, no scored row, no incoming gradient): d_hidden and d_weight zeros, the padding
    too; with a main_grad owner, main_grad untouched and Megatron's placeholder returned with its flag set."""
    grads = _garbage_filled(
        InputGradients((True, True), ((3, 2), torch.bfloat16), ((5, 2), torch.bfloat16), 4, 0, None, "cpu")
    )
    d_hidden, d_weight = grads.finish()
    assert torch.equal(d_hidden, torch.zeros(3, 2, dtype=torch.bfloat16))
    assert torch.equal(d_weight, torch.zeros(5, 2, dtype=torch.bfloat16))
    weight = torch.nn.Parameter(torch.randn(5, 2))
    weight.main_grad = torch.randn(5, 2)
    weight.grad_added_to_main_grad, weight.zero_out_wgrad = False, True
    before = weight.main_grad.clone()
    grads = InputGradients((False, True), ((3, 2), torch.float32), ((5, 2), torch.float32), 4, 0, weight, "cpu")
    assert grads.weight is None and grads.hidden is None
    d_hidden, placeholder = grads.finish()
    assert d_hidden is None and torch.equal(weight.main_grad, before)
    assert weight.grad_added_to_main_grad and torch.equal(placeholder, torch.zeros(5, 2))


def test_input_gradients_add_onto_main_grad():
    """With an fp32 main_grad the blocks' products add onto what it holds (no buffer), d_weight is not returned
    (None: the weight has no DDP flag)."""
    weight = torch.nn.Parameter(torch.randn(6, 3))
    weight.main_grad = torch.randn(6, 3)
    before = weight.main_grad.clone()
    products = _products(3, 4, 5, 3, seed=8)
    grads = InputGradients((False, True), ((4, 3), torch.float32), ((6, 3), torch.float32), 5, 4, weight, "cpu")
    grads.start(len(products))
    for a, b in products:
        grads.weight_sum.add(a, b)
    assert grads.finish() == (None, None)
    torch.testing.assert_close(
        weight.main_grad[:5].double(), before[:5].double() + _exact(products), rtol=1e-6, atol=1e-5
    )
    assert torch.equal(weight.main_grad[5:], before[5:])
