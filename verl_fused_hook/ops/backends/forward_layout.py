"""The forward kernel's layout arithmetic (pure functions of counts, no GPU): how many column tiles each program
streams, and how many rows one launch takes so that its per-tile partials stay bounded.

A row's values never depend on either (each tile's partial is its own, merged in an order fixed by the shard's
width: triton_kernels.forward_statistics_kernel), so both follow the call's row count freely, for speed and memory.
"""

from __future__ import annotations

import functools

# Each split pays a prologue and a partial-statistics store, worth about this many column tiles.
SPLIT_OVERHEAD_TILES = 0.5
# The forward's per-tile partials (4 fp32 planes of [column tiles, rows], 5 with square sums) of one launch stay
# under this size; more rows run as several launches (triton_backend.forward_partials). 151936 columns: 9.3 KiB a
# row, 27k rows a launch.
TILE_PARTIALS_BUDGET_BYTES = 256 * 1024**2
# Programs running together share few row blocks (kept in L2) and stream a few vocabulary splits; with one
# split, 132 programs would each stream their own 1 MiB row block per tile.
MIN_SPLITS = 8


def _modelled_time(per: int, row_blocks: int, col_tiles: int, slots: int) -> int | float:
    """Waves of programs times the tiles each streams plus its overhead: the forward's time in tile units."""
    splits = -(-col_tiles // per)
    return -(-(row_blocks * splits) // slots) * (per + SPLIT_OVERHEAD_TILES)


def _split_candidates(col_tiles: int) -> list[int]:
    """Tiles per split with at least MIN_SPLITS splits (L2 locality) and no empty last split."""
    return [
        per
        for per in range(1, -(-col_tiles // min(MIN_SPLITS, col_tiles)) + 1)
        if -(-col_tiles // per) * per - col_tiles < per
    ]


@functools.lru_cache(maxsize=1024)  # host time before the launch is GPU idle time
def tiles_per_split(col_tiles: int, slots: int, row_blocks: int) -> int:
    """Column tiles per program of the forward kernel: the layout of least modelled time for `row_blocks` blocks of
    rows, the fastest."""
    return min(_split_candidates(col_tiles), key=lambda per: (_modelled_time(per, row_blocks, col_tiles, slots), per))


def tile_partial_rows(col_tiles: int, planes: int, block_m: int) -> int:
    """Rows of one forward launch whose per-tile partials (`planes` fp32 planes) fit TILE_PARTIALS_BUDGET_BYTES, in
    whole row blocks."""
    return max(block_m, TILE_PARTIALS_BUDGET_BYTES // (4 * planes * col_tiles) // block_m * block_m)
