"""The Triton forward's persistent layout (`triton_backend.forward_layout`): which programs walk which tiles.

Pure host arithmetic, so it runs anywhere; the kernel that follows the layout is checked against fp64 in
tests/test_triton_interpreter.py (CPU) and tests/gpu/test_triton_backend.py (H200)."""

from __future__ import annotations

import pytest

from verl_fused_hook.ops.triton_backend import IN_FLIGHT_LIMIT, forward_layout

H200_SMS = 132
# (rows, valid columns) of the benchmark tables: TP=1 vocabularies, tensor-parallel shards, few and many rows.
SHAPES = [(512, 151936), (2048, 151936), (8192, 151936), (16384, 152064), (32768, 151936), (65536, 151936),
          (262144, 151936), (32768, 128256), (65536, 18992), (65536, 37984), (131072, 62080), (100, 151936)]


def _tiles_per_program(row_blocks, col_tiles, lanes, splits):
    """What the kernel walks: its lane's row blocks times its split's tiles (splits differ by at most one)."""
    widest = max((s + 1) * col_tiles // splits - s * col_tiles // splits for s in range(splits))
    return -(-row_blocks // lanes) * widest


@pytest.mark.parametrize("rows,columns", SHAPES)
def test_layout_fills_the_gpu_evenly_within_the_in_flight_limit(rows, columns):
    row_blocks, col_tiles = -(-rows // 128), -(-columns // 256)
    lanes, splits = forward_layout(row_blocks, col_tiles, H200_SMS, 128, 256)
    assert 1 <= lanes <= row_blocks and 1 <= splits <= col_tiles and lanes * splits <= H200_SMS
    in_flight = lanes * 128 + (splits * 256 if lanes < row_blocks else 0)
    assert in_flight <= IN_FLIGHT_LIMIT
    even_share = row_blocks * col_tiles / H200_SMS
    walked = _tiles_per_program(row_blocks, col_tiles, lanes, splits)
    # Every shape of the table but the smallest lands within 4.5% of the even share (splits pay FLUSH_TILES).
    if rows >= 512:
        assert walked <= 1.045 * even_share, (lanes, splits, walked, even_share)


def test_tensor_parallel_shard_beats_one_program_per_split():
    """65536 rows of a TP=8 shard (75 column tiles): the old launch (one program per row block and split of at
    most 10 tiles, 8 or more splits, in waves of 132) cost at best 322.5 tile times; the persistent walk 300."""
    lanes, splits = forward_layout(512, 75, H200_SMS, 128, 256)
    assert (lanes, splits) == (26, 5)
    assert _tiles_per_program(512, 75, lanes, splits) == 300


def test_interpreter_case_walks_several_row_blocks_per_program():
    """tests/test_triton_interpreter.py's unmasked case (70 rows, 301 columns, 16 x 32 tiles, four "SMs"):
    2 lanes x 2 splits, so a program stores one row block's statistics and starts the next inside its walk."""
    assert forward_layout(5, 10, 4, 16, 32) == (2, 2)


def test_one_wave_of_lanes_ignores_the_weight_columns_in_flight():
    """512 rows: every row block in flight at once, so the weight is read once whatever the splits: 4 x 33."""
    assert forward_layout(4, 594, H200_SMS, 128, 256) == (4, 33)
