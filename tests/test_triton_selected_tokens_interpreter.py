"""`token_log_probs`' Triton path on the CPU through Triton's interpreter (TRITON_INTERPRET=1), against fp64 and the
torch math: the gather-dot (`token_logits_kernel`), the sparse fix-up (`add_sparse_gradient_kernel`), the statistics
kernel's SQUARES flag, the top-k path over kept fp32 logits (STORE and RAW) in several chunks, and the whole op
forward and backward.

The named fakes of tests/test_triton_interpreter.py (fp16 for bf16, small tiles, four "SMs", cuBLAS's fp32-output
addmm, the availability check) are its `_interpret_on_cpu`. Tolerances: fp32 values 1e-5 absolute; fp16 d_logits
(2^-11 rounding, the sparse entries rounded twice) 1e-3 relative for the gradients.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_triton_interpreter import _run_interpreted as run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

VALUE_TOL = 1e-5
GRAD_TOL = 1e-3


def _kernel_cases() -> dict:
    """Run in the subprocess: each kernel against the torch math on the same inputs."""
    import torch
    from test_triton_interpreter import _interpret_on_cpu

    from verl_fused_hook.ops.arguments import build_problem
    from verl_fused_hook.ops.backends import triton_kernels
    from verl_fused_hook.ops.backends.triton_selected_tokens import (
        GROUP_COLUMNS,
        KeptLogits,
        statistics_with_squares,
        token_logits,
    )
    from verl_fused_hook.ops.softmax_math import inverse_temperature, label_columns
    from verl_fused_hook.ops.token_math import combine_duplicate_columns, square_sum

    triton_backend = _interpret_on_cpu()
    g = torch.Generator().manual_seed(3)
    n, h, v, k = 21, 200, 150, 19  # H not a multiple of the gather-dot's 128, k of its 16
    hidden = torch.randn(n, h, generator=g).half()
    weight = (torch.randn(v, h, generator=g) * 0.3).half()
    inv_temp = (torch.rand(n, generator=g) + 0.5).reciprocal()
    columns = torch.randint(-1, v, (n, k), generator=g)
    got = token_logits(hidden, weight, columns, inv_temp)
    want = (hidden.double() @ weight.double().t() * inv_temp.double().unsqueeze(1)).gather(1, columns.clamp_min(0))
    want = torch.where(columns >= 0, want, 0.0)
    results = {"gather_dot": (got.double() - want).abs().max().item()}

    # the sparse part: sorted by column and combined once (against combine_duplicate_columns, bit for bit, with runs
    # of up to ~6 equal columns, -1 among them, a -0.0 coefficient), then added to each chunk of 40 columns of an
    # fp16 d_logits row tile [n, 40] (a strided view, as the backward's tile), chunk by chunk
    from verl_fused_hook.ops.backends.triton_selected_tokens import _sparse_adder
    from verl_fused_hook.ops.token_math import SparseLogitGradient

    columns = torch.randint(-1, v, (n, k), generator=g)
    columns[:, 5:11] = columns[:, 4:5]  # a run of seven
    columns[3] = torch.randint(-1, 3, (k,), generator=g)  # runs of ~6
    coefficients = torch.randn(n, k, generator=g)
    coefficients[:, 2] = -0.0
    combined = combine_duplicate_columns(columns, coefficients)
    chunks = -(-v // 40)
    by_column = torch.empty(n, k, dtype=torch.int32)
    sums = torch.empty(n, k)
    bounds = torch.empty(n, chunks + 1, dtype=torch.int32)
    triton_kernels.sort_sparse_gradient_kernel[(n,)](
        columns, coefficients, k, by_column, sums, bounds, 40, chunks, BLOCK=32
    )
    sums_exact = True
    for row in range(n):
        kept = combined.columns[row] >= 0
        order = torch.sort(combined.columns[row][kept]).indices
        owners = by_column[row] >= 0
        sums_exact &= torch.equal(by_column[row][owners].long(), combined.columns[row][kept][order])
        sums_exact &= torch.equal(sums[row][owners], combined.coefficients[row][kept][order])  # bit for bit
        sums_exact &= bool((sums[row][~owners] == 0).all())
        sorted_columns = torch.sort(columns[row]).values
        want_bounds = [int((sorted_columns < c * 40).sum()) for c in range(chunks + 1)]
        sums_exact &= bounds[row].tolist() == want_bounds
    add = _sparse_adder(SparseLogitGradient(columns, coefficients), inv_temp, v, 40)
    chunk_exact = True
    for start in range(0, v, 40):
        width = min(40, v - start)
        dz = torch.randn(n, 48, generator=g).half()[:, :width]
        expected = dz.float().clone()
        inside = (combined.columns >= start) & (combined.columns < start + width)
        for row, j in inside.nonzero().tolist():
            expected[row, combined.columns[row, j] - start] += combined.coefficients[row, j] * inv_temp[row]
        add(dz[:13], slice(0, 13), start)  # two row tiles, as the backward's
        add(dz[13:], slice(13, n), start)
        chunk_exact &= torch.equal(dz.float(), expected.half().float())
    results["fix_up_exact"] = chunk_exact
    results["sorted_sums_exact"] = sums_exact

    # the SQUARES flag: square sums per row (several splits merged) against the torch math
    labels = torch.randint(0, v, (n,), generator=g)
    temperature = inv_temp.reciprocal()
    problem = build_problem(
        hidden,
        weight,
        labels,
        temperature=temperature,
        tp_group=None,
        score_mask=None,
        ignore_index=-100,
        vocab_size=None,
        calculate_entropy=True,
        tile_rows=None,
    )
    rows = problem.active_rows
    partials, squares = statistics_with_squares(
        problem, hidden, weight, label_columns(problem, rows).int(), inverse_temperature(temperature, rows), True, None
    )
    z = hidden.double() @ weight.double().t() * inv_temp.double().unsqueeze(1)
    results["squares"] = ((squares.double() - square_sum(z)) / square_sum(z)).abs().max().item()
    results["row_max"] = (partials.row_max.double() - z.amax(1)).abs().max().item()

    # STORE and RAW (the top-k's kept logits): raw fp32 logits, every tile's max and every 16-column group's max, the
    # last tile's padding columns left out
    width = triton_backend.FORWARD_CONFIG.block_n
    tiles = -(-v // width)
    kept = KeptLogits.allocate(n, v, width, "cpu")
    group = kept.group_columns  # a quarter of the interpreter's 32-wide tiles (GROUP_COLUMNS on the GPU's 256)
    assert group == min(GROUP_COLUMNS, width // 4) and kept.group_max.shape == (n, tiles * width // group)
    statistics_with_squares(
        problem, hidden, weight, label_columns(problem, rows).int(), inverse_temperature(temperature, rows), True, kept
    )
    raw = hidden.double() @ weight.double().t()
    results["kept_raw"] = ((kept.raw.double() - raw).abs().max() / raw.abs().max()).item()
    padded = torch.cat([kept.raw, kept.raw.new_full((n, tiles * width - v), -1.0e30)], 1)  # the kernel's NEG
    results["group_max_exact"] = bool(torch.equal(kept.group_max, padded.view(n, -1, group).amax(2)))
    results["tile_max_exact"] = bool(torch.equal(kept.tile_max, padded.view(n, tiles, width).amax(2)))
    return results


def _op_cases() -> list[dict]:
    """Run in the subprocess: the whole op through the Triton passes, against fp64."""
    import torch
    from selected_tokens_cases import make_case, max_abs, reference, rel, run_case, scored_rows
    from test_triton_interpreter import _interpret_on_cpu

    from verl_fused_hook.ops import backward_plan
    from verl_fused_hook.ops.backends import triton_backend, triton_selected_tokens

    _interpret_on_cpu()
    results = []
    for name, options, chunk_bytes in [
        ("top-k in chunks of 16 rows", {}, 16 * (4 * 208 + 4 * 7 + 8 * 5) + 1),
        ("top-k in one chunk, one temperature", {"per_row_temperature": False}, 1024**3),
        ("ids without top-k, every row", {"masked": False}, None),
    ]:
        case = make_case(n=70, h=64, padded=203, vocab=197, k=6, dtype=torch.float16, **options)
        top_k = 5 if chunk_bytes else 0
        want = reference(case, top_k=top_k)
        out, d_hidden, d_weight = run_case(
            case, top_k=top_k, calculate_sum_pi_squared=True, backend="triton", top_k_chunk_bytes=chunk_bytes
        )
        off = ~scored_rows(case)
        result = {
            "case": name,
            "d_hidden": rel(d_hidden, want["d_hidden"]),
            "d_weight": rel(d_weight, want["d_weight"]),
            "off_rows_zero": bool((d_hidden[off] == 0).all() and (out.token_log_probs[off] == 0).all()),
        }
        for field in ("log_probs", "entropy", "token_log_probs", "sum_pi_squared") + (
            ("top_log_probs",) if top_k else ()
        ):
            result[field] = max_abs(getattr(out, field), want[field])
        if top_k:
            result["top_ids_exact"] = bool(torch.equal(out.top_ids, want["top_ids"]))
        if chunk_bytes and chunk_bytes < 1024**3:  # a row's outputs do not depend on the chunk it sits in
            one_chunk = run_case(
                case, top_k=top_k, calculate_sum_pi_squared=True, backend="triton", top_k_chunk_bytes=1024**3
            )[0]
            result["same_bits_in_one_chunk"] = all(
                torch.equal(getattr(out, field), getattr(one_chunk, field))
                for field in ("log_probs", "entropy", "token_log_probs", "top_ids", "top_log_probs", "sum_pi_squared")
            )
        results.append(result)

    # top-3 of 2003 columns (62 whole tiles of 32 and a partial one): top_k_kernel reads 3 groups a row
    case = make_case(n=40, h=64, padded=2016, vocab=2003, k=4, dtype=torch.float16)
    want = reference(case, top_k=3)
    out, d_hidden, d_weight = run_case(case, top_k=3, backend="triton")
    results.append(
        {
            "case": "top-3 from the best groups",
            "d_hidden": rel(d_hidden, want["d_hidden"]),
            "d_weight": rel(d_weight, want["d_weight"]),
            "off_rows_zero": bool((d_hidden[~scored_rows(case)] == 0).all()),
            "top_log_probs": max_abs(out.top_log_probs, want["top_log_probs"]),
            "top_ids_exact": bool(torch.equal(out.top_ids, want["top_ids"])),
            "selection_kernel": triton_selected_tokens._selection_blocks(2003, 32, 3) is not None,
        }
    )

    # d_weight added into an fp32 main_grad (megatron's DDP protocol), the rows walked in groups of one row block
    backward_plan.IN_PLACE_WALK_BYTES = 1
    case = make_case(n=70, h=64, padded=203, vocab=197, k=6, dtype=torch.float16)
    want = reference(case, top_k=0)
    weight = torch.nn.Parameter(case.weight.clone())
    weight.main_grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(5))
    weight.grad_added_to_main_grad = False
    before = weight.main_grad.clone()
    out, d_hidden, _ = run_case(
        case, weight, calculate_sum_pi_squared=True, backend="triton", gradient_accumulation_fusion=True
    )
    results.append(
        {
            "case": "d_weight into main_grad in row groups",
            "d_hidden": rel(d_hidden, want["d_hidden"]),
            "d_weight": rel(weight.main_grad.double() - before.double(), want["d_weight"]),
            "placeholder": bool(weight.grad_added_to_main_grad) and weight.grad is not None,
            "off_rows_zero": bool((d_hidden[~scored_rows(case)] == 0).all()),
            "row_groups": len(
                backward_plan.row_groups(
                    int(scored_rows(case).sum()),
                    64,
                    case.vocab_size,
                    True,
                    True,
                    True,
                    block_m=triton_backend.GRAD_CONFIG.block_m,
                    block_n=triton_backend.GRAD_CONFIG.block_n,
                )
            ),
        }
    )
    return results


def _top_k_cases() -> list[dict]:
    """Run in the subprocess: `top_candidates` (top_k_kernel, and torch.topk past its limits) on rows built to break a
    selection that ranks groups before columns, against a full sort: the set is the top `wanted` by (logit, then lower
    column), ordered as select_top orders it; each row alone gives the same bits. Each case's log lines are kept."""
    import logging

    import torch

    from verl_fused_hook.ops.backends import triton_selected_tokens as selected
    from verl_fused_hook.ops.token_math import select_top

    width, columns, rows, start = 256, 600 * 256 + 37, 12, 1000  # the GPU's tiles and groups; a partial last tile
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, columns, generator=generator) * 3
    logits[1, 512:768] += 20  # every large value in one tile
    logits[2, -37:] += 20  # the largest in the partial last tile
    logits[3, ::257] += 15  # one large value in nearly every tile
    logits[4, 1040:1056] += 20  # the 16 largest in one group
    logits[5, 3000:3400:3] += 20  # many groups of two tiles
    logits[6] = logits[6].half().float()  # many equal values
    logits[7] = 0.0  # every value equal
    logits[8] = (logits[8] > 2).float() * 5  # ~350 equal maxima in many tiles, the rest equal too
    logits[9, ::7] = 4.0  # equal values in every tile and group at the top
    logits[10, ::2] = -0.0  # signed zeros at the top: equal values
    logits[10, 1::2] = -logits[10, 1::2].abs() - 1
    logits[11] = logits[11] * 1e4  # large magnitudes
    tiles = -(-columns // width)
    padded = torch.cat([logits, logits.new_full((rows, tiles * width - columns), -1.0e30)], 1)  # the kernel's NEG
    group_max = padded.view(rows, tiles * width // 16, 16).amax(2)  # as the kernel writes them (GROUP_N = 16)
    tile_max = padded.view(rows, tiles, width).amax(2)
    inv_temp = torch.rand(rows, generator=generator) + 0.5
    said = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    selected.logger.addHandler(handler)
    selected.logger.setLevel(logging.INFO)
    # asked columns (a teacher's ids): 130, more than the kernel reads at once, some held by no column (-1)
    asked = torch.randint(-1, columns, (rows, 130), generator=generator)
    asked[:, :5] = -1
    want_asked = torch.where(asked >= 0, logits.gather(1, asked.clamp_min(0)) * inv_temp[:, None], 0.0)
    results = []
    for wanted in (24, 128, 400, 2000):  # 2000: past MAX_SELECTION_TOP_K (1024), torch.topk over every column
        said.clear()
        kept = selected.KeptLogits(logits, tile_max, group_max, width, 16)
        values, ids, asked_logits = selected.top_candidates(kept, inv_temp, wanted, start, asked)
        plain_values, plain_ids, none = selected.top_candidates(kept, inv_temp, wanted, start)
        by_column = torch.sort(logits, dim=1, descending=True, stable=True).indices[:, :wanted]
        want_values, want_ids = select_top(logits.gather(1, by_column) * inv_temp[:, None], by_column + start, wanted)
        alone = all(
            torch.equal(
                torch.cat(
                    selected.top_candidates(
                        selected.KeptLogits(logits[r : r + 1], tile_max[r : r + 1], group_max[r : r + 1], width, 16),
                        inv_temp[r : r + 1],
                        wanted,
                        start,
                    )[:2],
                    1,
                ),
                torch.cat([values[r : r + 1], ids[r : r + 1].to(values.dtype)], 1),
            )
            for r in (6, 7, 8, 9)
        )
        results.append(
            {
                "wanted": wanted,
                "kernel": selected._selection_blocks(columns, width, wanted) is not None,
                "same_ids": torch.equal(ids, want_ids),
                "same_values": torch.equal(values, want_values),
                "asked_logits": torch.equal(asked_logits, want_asked),
                "without_asked": none is None and torch.equal(plain_values, values) and torch.equal(plain_ids, ids),
                "rows_alone": alone,
                "said": list(said),
            }
        )
    # a shard narrower than k groups and k columns: every group picked, the k padded
    narrow = torch.cat([logits[:, :100], logits.new_full((rows, 156), -1.0e30)], 1)  # groups past 100: padding
    kept = selected.KeptLogits(
        logits[:, :100], narrow.amax(1, keepdim=True), narrow.view(rows, 16, 16).amax(2), width, 16
    )
    narrow_asked = asked.clamp_max(99)[:, :20]
    values, ids, asked_logits = selected.top_candidates(kept, inv_temp, 120, start, narrow_asked)
    order = torch.sort(logits[:, :100], dim=1, descending=True, stable=True).indices
    want_values, want_ids = select_top(logits[:, :100].gather(1, order) * inv_temp[:, None], order + start, 100)
    want_asked_narrow = torch.where(
        narrow_asked >= 0, logits.gather(1, narrow_asked.clamp_min(0)) * inv_temp[:, None], 0.0
    )
    results.append(
        {
            "wanted": 120,
            "kernel": True,
            "same_ids": torch.equal(ids[:, :100], want_ids) and bool((ids[:, 100:] == -1).all()),
            "same_values": torch.equal(values[:, :100], want_values) and bool((values[:, 100:] == float("-inf")).all()),
            "asked_logits": torch.equal(asked_logits, want_asked_narrow),
            "without_asked": True,
            "rows_alone": True,
            "said": [],
        }
    )
    return results


def _run_interpreted(function: str):
    return run_interpreted(function, Path(__file__).stem)


def test_selected_token_kernels_in_the_interpreter():
    results = _run_interpreted("_kernel_cases")
    assert results["gather_dot"] <= VALUE_TOL, results
    assert results["sorted_sums_exact"], results  # the torch combine's bits, sorted by column; the chunk bounds
    assert results["fix_up_exact"], results  # fp16(old + c / T), the same rounding as the torch expectation
    assert results["squares"] <= VALUE_TOL and results["row_max"] <= VALUE_TOL, results
    assert results["kept_raw"] <= 1e-6 and results["group_max_exact"] and results["tile_max_exact"], results


def test_token_log_probs_triton_path_in_the_interpreter():
    cases = _run_interpreted("_op_cases")
    assert len(cases) == 5
    for case in cases:
        label = case["case"]
        assert case["off_rows_zero"], label
        for field in ("log_probs", "entropy", "token_log_probs", "sum_pi_squared", "top_log_probs"):
            assert case.get(field, 0.0) <= VALUE_TOL, (label, field, case)
        assert case.get("top_ids_exact", True), case
        assert case["d_hidden"] <= GRAD_TOL and case["d_weight"] <= GRAD_TOL, case
        assert case.get("placeholder", True) and case.get("row_groups", 2) > 1, case
        assert case.get("selection_kernel", True), case  # the case's shape takes top_k_kernel
        assert case.get("same_bits_in_one_chunk", True), case
    assert cases[0]["same_bits_in_one_chunk"] is True


def test_top_k_kernel_against_a_full_sort():
    """Every top-k of the Triton path is the exact top `wanted` by (logit, then lower id), whatever bunches the largest
    logits into a tile or a group, equal values (all, many, signed zeros), magnitudes of 1e4, a shard narrower than
    k; past the kernel's limits torch.topk gives the same, and a log line says so (the kernel's cases say nothing).
    The asked columns' logits read in the same launch are the bits of a torch gather (130 columns, -1 among them)."""
    cases = _run_interpreted("_top_k_cases")
    assert [case["kernel"] for case in cases] == [True, True, True, False, True], cases
    for case in cases:
        assert case["same_ids"] and case["same_values"] and case["rows_alone"], case
        assert case["asked_logits"] and case["without_asked"], case  # the asked columns' logits, the same bits
        assert len(case["said"]) == (0 if case["kernel"] else 1), case
    (line,) = cases[3]["said"]
    assert "top_k=2000" in line and "top_k <= 1024" in line and "torch.topk over every column" in line, line
