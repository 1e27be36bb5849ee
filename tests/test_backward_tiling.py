"""The Triton backward's chunk width (`backward_plan.backward_tiling`): pure arithmetic, checked on the CPU.

The width is the nominal CHUNK_COLUMNS widened by at most MAX_CHUNK_WIDENING (a quarter) so that the gradient kernel's
launches (a row tile's row blocks x a chunk's column tiles, one program per SM) fill whole waves. These tests
hold the rule to a brute-force count of waves, the memory budget and the bounds, at the SM counts of the
H100/H200 (132), H100 PCIe (114) and H20 (78). Below ~13000 rows the chunks are instead a few equal wide ones
(SMALL_WALK_TILE_BYTES of d_logits), held to their budgets and to the point where they give way.
"""

from __future__ import annotations

import pytest

from verl_fused_hook.ops import backward_plan as t
from verl_fused_hook.ops.backends.triton_backend import GRAD_CONFIG

BLOCK_M, BLOCK_N = GRAD_CONFIG.block_m, GRAD_CONFIG.block_n


def _waves(tiling: t.BackwardTiling, rows: int, valid_columns: int, slots: int) -> int:
    """Waves of the gradient kernel over the whole walk, launch by launch as recomputed_gradients makes them."""
    waves = 0
    for _, count in tiling.tiles(rows):
        for start in range(0, valid_columns, tiling.columns):
            tiles = -(-count // BLOCK_M) * -(-min(tiling.columns, valid_columns - start) // BLOCK_N)
            waves += -(-tiles // slots)
    return waves


SHAPES = [
    (16384, 3584, 152064),
    (32768, 4096, 151936),
    (65536, 2048, 151936),
    (32768, 8192, 128256),
    (131072, 4096, 151936),
    (65536, 4096, 18992),
    (12288, 4096, 37984),
    (16384, 5120, 248320),
]


@pytest.mark.parametrize("slots", [132, 114, 78])
@pytest.mark.parametrize("n, h, v", SHAPES)
def test_width_fills_waves_within_bounds_and_budget(n, h, v, slots):
    tiling = t.backward_tiling(n, h, v, BLOCK_M, BLOCK_N, slots)
    nominal = t.nominal_chunk_columns(v, BLOCK_N)
    widest = nominal + int(nominal * t.MAX_CHUNK_WIDENING) // BLOCK_N * BLOCK_N
    assert tiling.columns % BLOCK_N == 0
    assert nominal <= tiling.columns <= widest
    assert 2 * tiling.rows * tiling.columns <= t.TILE_MEMORY_BUDGET
    # no width in the range takes fewer waves (the rule's own count agrees with a launch-by-launch count)
    waves = _waves(tiling, n, v, slots)
    for columns in range(nominal, widest + 1, BLOCK_N):
        other = t._row_tiling(n, h, columns, BLOCK_M)
        assert waves <= _waves(other, n, v, slots)


@pytest.mark.parametrize("n", [16384, 32768, 65536])
def test_h200_row_counts_take_33_tiles(n):
    """On 132 SMs every row count that is a multiple of 512 fills whole waves with 33 column tiles (132 = 4 x 33):
    8448 columns where 8192 left the last wave of each chunk partly empty (the measured 1.5-4%)."""
    tiling = t.backward_tiling(n, 4096, 151936, BLOCK_M, BLOCK_N, 132)
    assert tiling.columns == 33 * BLOCK_N
    nominal = t._row_tiling(n, 4096, t.CHUNK_COLUMNS, BLOCK_M)
    assert _waves(tiling, n, 151936, 132) < _waves(nominal, n, 151936, 132)


def test_narrow_shard_is_one_chunk():
    """A shard narrower than the nominal chunk is walked in one chunk of its own width."""
    tiling = t.backward_tiling(4096, 4096, 3000, BLOCK_M, BLOCK_N, 132)
    assert tiling.columns == -(-3000 // BLOCK_N) * BLOCK_N


def test_widening_leaves_the_nominal_width_where_it_already_fills_waves():
    """131072 rows of a 151936 vocabulary: 8192 columns already waste under 0.3% of a wave per launch on 132 SMs
    and no width in the range takes fewer waves, so the walk stays at the nominal width (the narrowest)."""
    tiling = t.backward_tiling(131072, 4096, 151936, BLOCK_M, BLOCK_N, 132)
    assert tiling.columns == t.CHUNK_COLUMNS


@pytest.mark.parametrize("h, v", [(4096, 151936), (3584, 152064), (4096, 128256), (5120, 248320), (8192, 128256)])
@pytest.mark.parametrize("n", [1, 100, 1024, 2048, 3000, 4096, 8192, 12288])
@pytest.mark.parametrize("slots", [132, 114, 78])
def test_few_rows_walk_wide_chunks_within_budget_and_fewest_waves(n, h, v, slots):
    tiling = t.backward_tiling(n, h, v, BLOCK_M, BLOCK_N, slots)
    nominal = t.nominal_chunk_columns(v, BLOCK_N)
    widest = t._small_walk_tiles(n, h, v, BLOCK_N)
    if widest is None:  # no wider than the waves' widening, or too much memory: the nominal rule
        assert nominal <= tiling.columns <= nominal * (1 + t.MAX_CHUNK_WIDENING)
        return
    total = -(-v // BLOCK_N)
    tiles = tiling.columns // BLOCK_N
    assert tiling.rows == n and tiling.columns % BLOCK_N == 0 and nominal <= tiling.columns
    # the d_logits tile within the budget (by at most the one tile each equal part is rounded up by), the walk
    # within what an in-place walk may take
    assert 2 * n * (tiles - 1) * BLOCK_N <= t.SMALL_WALK_TILE_BYTES
    assert 4 * h * n + 2 * n * tiling.columns <= t.IN_PLACE_WALK_BYTES

    def cost(width_tiles):  # waves launch by launch, plus the modelled cost of each chunk
        other = t.BackwardTiling(width_tiles * BLOCK_N, n)
        return _waves(other, n, v, slots) + t.SMALL_WALK_CHUNK_WAVES * -(-total // width_tiles)

    # no width of the widened nominal range and no equal part of the vocabulary up to the widest costs less
    most = int(nominal * (1 + t.MAX_CHUNK_WIDENING)) // BLOCK_N
    equal_parts = {-(-total // chunks) for chunks in range(1, total + 1)}
    others = [w for w in range(nominal // BLOCK_N, widest + 1) if w <= most or w in equal_parts]
    assert all(cost(tiles) <= cost(other) for other in others)


def test_chunks_widen_as_rows_fall_and_give_way_near_12000_rows():
    """At 151936 columns on 132 SMs: 2 chunks at 1024 rows, 3 at 2048, 5 at 4096, 14 at 8192; the nominal
    8448-column walk (18 chunks) from 12288 rows, and never fewer chunks for more rows."""
    chunks = {n: -(-151936 // t.backward_tiling(n, 4096, 151936, BLOCK_M, BLOCK_N, 132).columns) for n in
              (512, 1024, 2048, 4096, 8192, 12288, 13312, 16384, 32768)}  # fmt: skip
    assert [chunks[n] for n in (1024, 2048, 4096, 8192)] == [2, 3, 5, 14]
    assert chunks[12288] == chunks[16384] == chunks[32768] == 18
    counts = [chunks[n] for n in sorted(chunks)]
    assert counts == sorted(counts)
