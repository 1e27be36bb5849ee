"""`token_log_probs` with the portable backend on the CPU, against the fp64 reference (tests/selected_tokens_cases.py).

Tolerances: values are fp32 logits of sums over H = 24 products (1e-5 absolute covers their rounding, 1e-6
measured); gradients are fp32 sums over the vocabulary (1e-5 relative, Frobenius). Logits offset by +-1e4 / T
(T >= 0.5): fp32 holds them to 2^-9, and a sum of 24 products rounds a few times: 8 ulps (1.6e-2) absolute for the
values (5.7e-3 measured), and as much relative for the gradients (p's relative error is z's absolute one; 1.1e-3
measured).
"""

from __future__ import annotations

import pytest
import torch
from selected_tokens_cases import make_case, max_abs, reference, rel, run_case, scored_rows

from verl_fused_hook import TokenLogProbs, token_log_probs
from verl_fused_hook_harness.support.memory import PeakMemory

VALUE_TOL = 1e-5
GRAD_TOL = 1e-5


def run(case, top_k=0, backend="torch", tile_rows=8, **kwargs) -> tuple[TokenLogProbs, torch.Tensor, torch.Tensor]:
    return run_case(case, top_k=top_k, calculate_sum_pi_squared=True, backend=backend, tile_rows=tile_rows, **kwargs)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"per_row_temperature": False, "masked": False},
        {"masked": False, "ignored_row": False},  # d_hidden written by row span, not by index
        {"padded": 211, "vocab": 211, "k": 1},
        {"k": 40},  # more ids than a tile has rows, many duplicates
    ],
    ids=[
        "per_row_temperature_masked",
        "one_temperature_every_row",
        "every_row_scored",
        "no_padding_one_id",
        "forty_ids",
    ],
)
def test_against_fp64(options):
    case = make_case(**options)
    want = reference(case, top_k=5)
    out, d_hidden, d_weight = run(case, top_k=5)
    for name in ("log_probs", "entropy", "token_log_probs", "sum_pi_squared", "top_log_probs"):
        assert max_abs(getattr(out, name), want[name]) <= VALUE_TOL, name
    assert torch.equal(out.top_ids, want["top_ids"])
    assert out.token_log_probs.dtype == torch.float32 and out.top_ids.dtype == torch.int64
    assert rel(d_hidden, want["d_hidden"]) <= GRAD_TOL
    assert rel(d_weight, want["d_weight"]) <= GRAD_TOL
    assert torch.count_nonzero(d_weight[case.vocab_size :]) == 0  # padding columns get nothing


def test_rows_not_computed_hold_zero_and_get_no_gradient():
    case = make_case()
    out, d_hidden, _ = run(case, top_k=3)
    off = ~scored_rows(case)
    assert off.any()
    for name in ("log_probs", "entropy", "token_log_probs", "top_log_probs", "sum_pi_squared"):
        assert torch.count_nonzero(getattr(out, name)[off]) == 0, name
    assert (out.top_ids[off] == -1).all()
    assert torch.count_nonzero(d_hidden[off]) == 0


def test_extreme_logits():
    case = make_case(extreme=True)
    want = reference(case, top_k=4)
    out, d_hidden, d_weight = run(case, top_k=4)
    for name in ("log_probs", "entropy", "token_log_probs", "sum_pi_squared", "top_log_probs"):
        assert torch.isfinite(getattr(out, name)).all(), name
        assert max_abs(getattr(out, name), want[name]) <= 8 * 2**-9, name
    assert rel(d_hidden, want["d_hidden"]) <= 8 * 2**-9 and rel(d_weight, want["d_weight"]) <= 8 * 2**-9


def test_empty_selection_and_no_rows():
    case = make_case(k=0)
    want = reference(case)
    out, d_hidden, _ = run(case)
    assert out.token_log_probs.shape == (37, 0)
    assert rel(d_hidden, want["d_hidden"]) <= GRAD_TOL
    case = make_case()
    case.score_mask = torch.zeros_like(case.score_mask)
    out, d_hidden, d_weight = run(case, top_k=2)
    assert torch.count_nonzero(out.token_log_probs) == 0 and (out.top_ids == -1).all()
    assert torch.count_nonzero(d_hidden) == 0 and torch.count_nonzero(d_weight) == 0


def test_only_token_gradients_flow():
    """No gradient through log_probs or entropy: the dense part is sum_j c_j alone."""
    case = make_case()
    case.g_lp.zero_()
    case.g_ent.zero_()
    want = reference(case)
    hidden = case.hidden.clone().requires_grad_()
    weight = case.weight.clone().requires_grad_()
    out = token_log_probs(
        hidden,
        weight,
        case.labels,
        case.token_ids,
        temperature=case.temperature,
        score_mask=case.score_mask,
        vocab_size=case.vocab_size,
        calculate_log_probs=False,
        calculate_entropy=False,
        backend="torch",
        tile_rows=8,
    )
    assert out.log_probs is None and out.entropy is None and out.top_ids is None and out.sum_pi_squared is None
    (out.token_log_probs * case.g_tokens).sum().backward()
    assert rel(hidden.grad, want["d_hidden"]) <= GRAD_TOL and rel(weight.grad, want["d_weight"]) <= GRAD_TOL


def test_duplicates_add_their_gradients():
    """An id asked twice gets the sum of both coefficients: the same gradient as once with their sum."""
    case = make_case(masked=False)
    twice = run(case)
    case.token_ids = case.token_ids[:, 1:]  # column 1 repeats column 0
    case.g_tokens = torch.cat([case.g_tokens[:, :1] + case.g_tokens[:, 1:2], case.g_tokens[:, 2:]], 1)
    once = run(case)
    assert rel(twice[1], once[1]) <= 1e-6 and rel(twice[2], once[2]) <= 1e-6


def test_matches_log_probs_and_entropy():
    """The label's log-prob and the entropy are log_probs_and_entropy's, bit for bit (one statistics pass)."""
    from verl_fused_hook import log_probs_and_entropy

    case = make_case()
    out = token_log_probs(
        case.hidden,
        case.weight,
        case.labels,
        case.token_ids,
        temperature=case.temperature,
        score_mask=case.score_mask,
        vocab_size=case.vocab_size,
        backend="torch",
        tile_rows=8,
    )
    log_probs, entropy = log_probs_and_entropy(
        case.hidden,
        case.weight,
        case.labels,
        temperature=case.temperature,
        score_mask=case.score_mask,
        vocab_size=case.vocab_size,
        backend="torch",
        tile_rows=8,
    )
    assert max_abs(out.log_probs, log_probs) <= 1e-6 and max_abs(out.entropy, entropy) <= 1e-6


def test_batch_invariance():
    """A row's outputs are bitwise the same alone and inside a bigger batch (with other rows masked around it)."""
    case = make_case(n=29, masked=False)
    everything = token_log_probs(
        case.hidden,
        case.weight,
        case.labels,
        case.token_ids,
        temperature=case.temperature,
        vocab_size=case.vocab_size,
        top_k=4,
        calculate_sum_pi_squared=True,
        backend="torch",
    )
    for row in (0, 13, 28):
        alone = token_log_probs(
            case.hidden[row : row + 1],
            case.weight,
            case.labels[row : row + 1],
            case.token_ids[row : row + 1],
            temperature=case.temperature[row : row + 1],
            vocab_size=case.vocab_size,
            top_k=4,
            calculate_sum_pi_squared=True,
            backend="torch",
        )
        for name, value in alone._asdict().items():
            assert torch.equal(value[0], getattr(everything, name)[row]), (name, row)


def test_ties_order_by_lower_id():
    """Equal logits: the lower id first."""
    hidden = torch.ones(2, 4)
    weight = torch.zeros(10, 4)
    weight[[7, 2, 5]] = 1.0  # three tied maxima
    out = token_log_probs(hidden, weight, torch.zeros(2, dtype=torch.long), top_k=3, backend="torch")
    assert out.top_ids.tolist() == [[2, 5, 7], [2, 5, 7]]


def test_second_order_gradients_are_refused():
    case = make_case()
    hidden = case.hidden.clone().requires_grad_()
    out = token_log_probs(hidden, case.weight, case.labels, case.token_ids, vocab_size=case.vocab_size, backend="torch")
    (grad,) = torch.autograd.grad(out.token_log_probs.sum(), hidden, create_graph=True)
    with pytest.raises(RuntimeError):
        grad.sum().backward()


def _call(**changes):
    case = make_case(n=6, k=3)
    arguments = dict(
        hidden=case.hidden,
        weight=case.weight,
        labels=case.labels,
        token_ids=case.token_ids,
        vocab_size=case.vocab_size,
        backend="torch",
    )
    arguments.update(changes)
    return token_log_probs(**arguments)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"token_ids": torch.zeros(6, 3)}, "token_ids: must be an integer tensor, got torch.float32"),
        ({"token_ids": torch.zeros(6, 3, dtype=torch.bool)}, "token_ids: must be an integer tensor, got torch.bool"),
        ({"token_ids": [[1, 2]] * 6}, "token_ids: expected an integer torch.Tensor or None, got list"),
        ({"token_ids": torch.zeros(6, dtype=torch.long)}, "token_ids: must be shaped like labels (6,) plus a last dim"),
        (
            {"token_ids": torch.zeros(5, 3, dtype=torch.long)},
            "token_ids: must be shaped like labels (6,) plus a last dim",
        ),
        (
            {"token_ids": torch.full((6, 3), 197)},
            "token_ids: ids must lie in [0, 197) (vocab_size) on every computed row, found 197",
        ),
        ({"token_ids": torch.full((6, 3), -1)}, "token_ids: ids must lie in [0, 197)"),
        ({"top_k": -1}, "top_k: must be an int >= 0, got -1"),
        ({"top_k": 198}, "top_k: must be an int in [0, 197] (vocab_size), got 198"),
        ({"top_k": 2.0}, "top_k: must be an int >= 0, got 2.0"),
        ({"top_k": True}, "top_k: must be an int >= 0, got True"),
        ({"top_k_chunk_bytes": 0}, "top_k_chunk_bytes: must be an int >= 1 or None, got 0"),
        ({"top_k_chunk_bytes": 1e9}, "top_k_chunk_bytes: must be an int >= 1 or None, got 1000000000.0"),
        ({"calculate_sum_pi_squared": 1}, "calculate_sum_pi_squared: expected a bool, got 1"),
        ({"calculate_log_probs": None}, "calculate_log_probs: expected a bool, got None"),
        ({"backend": "verl"}, "backend: 'verl' cannot run token_log_probs"),
        ({"backend": "cuda"}, "backend: unknown 'cuda'"),
        ({"labels": torch.full((6,), 500)}, "labels: ids must lie in [0, 197)"),
        ({"temperature": 0.0}, "temperature: must be finite and > 0"),
    ],
)
def test_bad_input_names_the_field(changes, message):
    with pytest.raises(ValueError) as error:
        _call(**changes)
    assert str(error.value).startswith(message), str(error.value)


def test_ids_of_rows_not_computed_are_not_read():
    case = make_case(n=6, k=3)
    ids = case.token_ids.clone()
    ids[2] = 10_000  # a padding row's garbage
    mask = torch.arange(6) != 2
    out = token_log_probs(
        case.hidden, case.weight, case.labels, ids, score_mask=mask, vocab_size=case.vocab_size, backend="torch"
    )
    assert torch.count_nonzero(out.token_log_probs[2]) == 0


def test_memory_does_not_grow_with_tokens_beyond_the_ids():
    """Peak live bytes of a forward+backward at N=2k vs N=16k (V=32k, k=32, top-32, sum pi^2, portable backend):
    no [N, V] tensor, and growth from N only the [N, k] ids, outputs and their gradients, d_hidden and O(N)
    vectors."""
    vocab, h, k, tile_rows = 32768, 64, 32, 256
    tile_bytes = tile_rows * vocab * 4
    weight = torch.randn(vocab, h, requires_grad=True)
    measured = {}
    for n in (2048, 16384):
        hidden = torch.randn(n, h, requires_grad=True)
        labels = torch.randint(0, vocab, (n,))
        ids = torch.randint(0, vocab, (n, k))
        with PeakMemory() as peak:
            out = token_log_probs(
                hidden, weight, labels, ids, top_k=k, calculate_sum_pi_squared=True, backend="torch",
                tile_rows=tile_rows,
            )  # fmt: skip
            (out.log_probs.sum() + out.entropy.sum() + out.token_log_probs.sum()).backward()
        measured[n] = (peak.peak, peak.largest)
        weight.grad = None
        del out
    (peak_small, largest_small), (peak_large, largest_large) = measured[2048], measured[16384]
    assert largest_small <= tile_bytes and largest_large <= tile_bytes  # no [N, V] tensor ever
    # per row: d_hidden and hidden's fp32 copies (2 h fp32), the [N, k] ids (int64), token log-probs, their
    # gradient and saved copies (fp32), top-k ids (int64) and log-probs (fp32), O(1) vectors
    per_row = 2 * h * 4 + k * (8 + 8 + 4 * 4) + 256
    growth = peak_large - peak_small
    assert growth <= (16384 - 2048) * per_row, (growth, (16384 - 2048) * per_row)
    assert peak_large <= 4 * tile_bytes + 2 * vocab * h * 4 + 16384 * per_row


def test_ties_at_the_top_k_boundary_take_the_lower_ids_with_batch_invariant():
    """300 equal logits and a top_k of 5 among them: with batch_invariant the 5 lowest of those ids, every row,
    alone or among others (torch.topk alone may take any 5 of the 300, and differently by the row count)."""
    hidden = torch.ones(6, 4)
    weight = torch.zeros(1000, 4)
    tied = torch.randperm(1000, generator=torch.Generator().manual_seed(0))[:300]
    weight[tied] = 1.0
    weight[tied[0]] = 2.0  # one clear maximum, then the tie at the boundary
    labels = torch.zeros(6, dtype=torch.long)
    expected = [tied[0].item(), *sorted(tied[1:].tolist())[:4]]
    for rows in (1, 6):
        out = token_log_probs(hidden[:rows], weight, labels[:rows], top_k=5, backend="torch", batch_invariant=True)
        assert out.top_ids.tolist() == [expected] * rows


def test_duplicate_columns_combine_onto_their_first_occurrence():
    """token_math.combine_duplicate_columns (the sparse gradient's duplicates: the label among the ids, repeated
    ids) against a sequential per-row sum: a column's first entry holds its entries' sum and the later ones -1 / 0,
    columns -1 stay -1 / 0. Exact bits for runs of one and two (c + 0 and a + b, the only sums distillation's distinct
    teacher ids give), 1e-6 relative for longer runs (another fixed order); a row alone gives the same bits."""
    from verl_fused_hook.ops.token_math import combine_duplicate_columns

    generator = torch.Generator().manual_seed(6)
    columns = torch.randint(-1, 12, (300, 129), generator=generator)  # runs of up to ~20 equal columns
    columns[:100] = torch.randperm(5000, generator=generator)[:129].expand(100, -1)  # distinct columns
    columns[:100, 7] = columns[:100, 90]  # one pair
    columns[100:110] = -1
    coefficients = torch.randn(300, 129, generator=generator)
    coefficients[:, 3] = -0.0
    combined = combine_duplicate_columns(columns, coefficients)
    for row in range(300):
        sums, first = {}, {}
        for j, (column, c) in enumerate(zip(columns[row].tolist(), coefficients[row].tolist(), strict=True)):
            if column >= 0:
                sums[column] = torch.tensor(c, dtype=torch.float32) + sums.get(column, 0.0)
                first.setdefault(column, j)
        expected_columns = torch.full((129,), -1)
        expected = torch.zeros(129)
        for column, j in first.items():
            expected_columns[j], expected[j] = column, sums[column]
        assert torch.equal(combined.columns[row], expected_columns)
        counts = torch.bincount(columns[row].clamp_min(0), minlength=5000)
        short = (columns[row] < 0) | (counts[columns[row].clamp_min(0)] <= 2)
        assert torch.equal(combined.coefficients[row][short] + 0.0, expected[short] + 0.0)
        assert torch.allclose(combined.coefficients[row], expected, rtol=1e-6, atol=1e-6)
    alone = combine_duplicate_columns(columns[150:151], coefficients[150:151])
    assert torch.equal(alone.columns, combined.columns[150:151])
    assert torch.equal(alone.coefficients, combined.coefficients[150:151])
    empty = combine_duplicate_columns(columns[:, :0], coefficients[:, :0])
    assert empty.columns.shape == (300, 0) and empty.coefficients.shape == (300, 0)
