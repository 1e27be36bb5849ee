"""The Triton backward's chunk width (`backward_plan.backward_tiling`): pure arithmetic, checked on the CPU.

The width is the nominal CHUNK_COLUMNS widened by at most MAX_CHUNK_WIDENING (a quarter) so that the gradient kernel's
launches (a row tile's row blocks x a chunk's column tiles, one program per SM) fill whole waves. These tests
hold the rule to a brute-force count of waves, the memory budget and the bounds, at the SM counts of the
H100/H200 (132), H100 PCIe (114) and H20 (78).
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
    (2048, 4096, 151936),
    (8192, 4096, 151936),
    (16384, 3584, 152064),
    (32768, 4096, 151936),
    (65536, 2048, 151936),
    (32768, 8192, 128256),
    (131072, 4096, 151936),
    (65536, 4096, 18992),
    (1000, 4096, 151936),
    (3000, 5120, 248320),
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


@pytest.mark.parametrize("n", [2048, 8192, 16384, 32768, 65536])
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
