"""How the Triton two-pass backward walks [scored rows x vocabulary]: chunk width, row tiles and row groups.

Pure arithmetic from fixed budgets, shapes and the SM count (triton_backend.recomputed_gradients walks what this
plans): from ~13000 rows (at 152k columns) the same chunks at every N; below, fewer and wider ones, since there the
nominal chunks are launches too small to keep the GPU busy.

Why row groups: each gradient is a sum over the other's dimension, and the one summed across the outer loop
needs an fp32 buffer to be rounded once. With the vocabulary outside (the default), that is d_hidden: 4 H
bytes per scored row, growing with N. When the rows outnumber the shard's vocabulary (long context,
tensor-parallel shards), the rows go outside in groups of ROW_GROUP_ROWS, each walking the whole
vocabulary, and d_weight is the sum kept in fp32 instead: 4 H bytes per shard column plus one group's
d_hidden, whatever N. `row_groups` takes the groups where they need GROUPS_MIN_SAVING_BYTES less memory
(they cost up to ~1% of time); either way each gradient is summed in fp32 and rounded once.
When d_weight goes into an fp32 `main_grad` (weight_gradient.py), that is already the fp32 sum: the groups then
cost no memory of their own and are as small as IN_PLACE_WALK_BYTES says, whatever N.
"""

from __future__ import annotations

from dataclasses import dataclass

from .chunking import equal_piece_rows

# Working memory of the backward beside the fp32 accumulator: the bf16 d_logits tile and, when the rows need
# more than one tile, the fp32 accumulator of the chunk's d_weight rows.
TILE_MEMORY_BUDGET = 1024 * 1024 * 1024
# Vocabulary columns per backward chunk. The fp32 d_hidden accumulator is read and written once per chunk:
# 8 bytes per row and hidden unit against 2 * CHUNK_COLUMNS flops of the chunk's products, far below
# what those take (Hopper's balance is ~165 flops per byte; 8192 columns give 2048).
CHUNK_COLUMNS = 8192
# The width walked is CHUNK_COLUMNS widened by at most this fraction (in whole column tiles) so that the
# gradient kernel's launches fill whole waves of the GPU's programs (`backward_tiling`). On the H200 (132 SMs),
# 8448 columns (33 tiles) against 8192, A/B in rounds over three runs: 0.956-0.968x the forward+backward time at
# 8192 x 4096 x 151936, 0.97-1.00x at 16384-65536 rows, H 2048-8192 (docs/benchmarks.md).
MAX_CHUNK_WIDENING = 0.25
# Below ~13000 rows (at 152k columns) the nominal chunks are small launches: at 1024 rows 18 chunks of 8 row blocks
# x 33 column tiles (two waves of 132 programs), each followed by its two GEMMs and a pass over the fp32 d_hidden.
# There the chunks widen, in equal parts of whole column tiles, to a d_logits tile of about this many bytes (2 chunks
# of 76032 columns at 1024 rows, 5 at 4096), as long as the walk stays within IN_PLACE_WALK_BYTES.
SMALL_WALK_TILE_BYTES = 256 * 1024**2
# What one more chunk costs there, in waves of the gradient kernel: at 1024 x 4096 x 151936 on an H100, 2 chunks of
# 297 tiles against 18 of 33 (36 waves each way) took 0.92x the forward+backward time, ~44 us a chunk saved, about
# one wave (132 tiles of 128 x 256 x 4096: ~36 us).
SMALL_WALK_CHUNK_WAVES = 1
# Rows per group when the rows go outside. Each group reads and writes the fp32 d_weight sum once per chunk:
# 8 bytes per shard column and hidden unit against 6 * ROW_GROUP_ROWS flops of its three GEMMs (24576 flops a
# byte at 32768 rows, against Hopper's balance of ~165).
ROW_GROUP_ROWS = 32768
# Groups cost up to ~1% of time (H200, against one walk: -0.4% to +0.1% at 131072 rows of 37984-62080-column
# shards, +1.3% at 65536 x 4096 x 18992 and +1.2% at 262144 x 4096 x 151936), so they are taken only where they
# spare at least this much memory (those five shapes: 0.68-1.61 GiB).
GROUPS_MIN_SAVING_BYTES = 512 * 1024**2
# A group's walk (its fp32 d_hidden and bf16 d_logits tile, at the nominal chunk width) when d_weight sums in place
# into an fp32 main_grad.
IN_PLACE_WALK_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class BackwardTiling:
    """How the backward walks [rows x vocabulary]: `columns` per chunk, `rows` per d_logits tile."""

    columns: int
    rows: int

    def tiles(self, total_rows: int) -> list[tuple[int, int]]:
        return [(start, min(self.rows, total_rows - start)) for start in range(0, total_rows, self.rows)]


def _row_tiling(rows: int, hidden_size: int, columns: int, block_m: int) -> BackwardTiling:
    """All rows in one d_logits tile when it fits TILE_MEMORY_BUDGET, else equal tiles of whole row blocks that fit
    it beside the chunk's fp32 d_weight accumulator."""
    rows = max(rows, 1)
    if 2 * rows * columns <= TILE_MEMORY_BUDGET:
        return BackwardTiling(columns, rows)
    fit = max(block_m, (TILE_MEMORY_BUDGET - 4 * columns * hidden_size) // (2 * columns) // block_m * block_m)
    return BackwardTiling(columns, equal_piece_rows(rows, fit, block_m))


def _chunk_tile_range(valid_columns: int, block_n: int) -> tuple[int, int]:
    """(nominal, most) column tiles per chunk: CHUNK_COLUMNS, and MAX_CHUNK_WIDENING wider; none past the shard's
    own tiles. Never narrower: each chunk reads and writes the fp32 d_hidden accumulator once (module docstring)."""
    total = -(-valid_columns // block_n)
    nominal = max(1, CHUNK_COLUMNS // block_n)
    return min(nominal, total), min(nominal + int(nominal * MAX_CHUNK_WIDENING), total)


def _small_walk_tiles(rows: int, hidden_size: int, valid_columns: int, block_n: int) -> int | None:
    """The widest chunk for few rows, in column tiles: equal parts of d_logits tiles within SMALL_WALK_TILE_BYTES;
    None where that is no wider than the waves' widening of the nominal chunk or the walk would pass
    IN_PLACE_WALK_BYTES."""
    total = -(-valid_columns // block_n)
    chunks = -(-2 * max(rows, 1) * total * block_n // SMALL_WALK_TILE_BYTES)
    tiles = -(-total // chunks)
    if tiles <= _chunk_tile_range(valid_columns, block_n)[1]:
        return None
    if 4 * hidden_size * rows + 2 * rows * tiles * block_n > IN_PLACE_WALK_BYTES:
        return None
    return tiles


def nominal_chunk_columns(valid_columns: int, block_n: int) -> int:
    """CHUNK_COLUMNS, or the shard's width when narrower: the width the memory models of `row_groups` assume (the
    walk may widen it to fill waves, by at most MAX_CHUNK_WIDENING of its d_logits tile)."""
    return _chunk_tile_range(valid_columns, block_n)[0] * block_n


def backward_tiling(
    rows: int, hidden_size: int, valid_columns: int, block_m: int, block_n: int, slots: int
) -> BackwardTiling:
    """Chunk width and row tiles of the backward's walk: of the widths in `_chunk_tile_range`, and for few rows the
    equal parts up to `_small_walk_tiles`' widest, the one whose gradient-kernel launches (a row tile's blocks x a
    chunk's column tiles, `slots` programs at a time) take the fewest waves over the whole walk, then the narrowest;
    for few rows, the fewest waves plus SMALL_WALK_CHUNK_WAVES a chunk, then the widest. 32 tiles over 64 row blocks
    leave the last of 16 waves half empty on 132 SMs; 33 fill them. At 12288 rows, 43-tile chunks gave that fill up
    and took 1.08x the time of 33-tile ones (H100), so waves decide the small walk too. Nothing depends on anything
    but budgets, shapes and the SM count."""
    total = -(-valid_columns // block_n)
    nominal, most = _chunk_tile_range(valid_columns, block_n)
    candidates = list(range(nominal, most + 1))
    wide = _small_walk_tiles(rows, hidden_size, valid_columns, block_n)
    if wide is not None:  # equal parts from the widest down to the widened nominal width
        candidates += {-(-total // chunks) for chunks in range(-(-total // wide), -(-total // most) + 1)}
    best, best_key = None, None
    for tiles in candidates:
        tiling = _row_tiling(rows, hidden_size, tiles * block_n, block_m)
        full, last = divmod(total, tiles)
        waves = 0
        for _, count in tiling.tiles(max(rows, 1)):
            blocks = -(-count // block_m)
            waves += full * -(-blocks * tiles // slots) + -(-blocks * last // slots)
        key = (waves, tiles) if wide is None else (waves + SMALL_WALK_CHUNK_WAVES * -(-total // tiles), -tiles)
        if best_key is None or key < best_key:
            best, best_key = tiling, key
    return best


def _vocabulary_outside_bytes(
    rows: int, hidden_size: int, valid_columns: int, want_hidden: bool, want_weight: bool, block_m: int, block_n: int
) -> int:
    """Working memory of one walk over the vocabulary for `rows` rows: the fp32 d_hidden accumulator, the d_logits
    tile, and the chunk's fp32 d_weight accumulator when the rows take several tiles (at the nominal width)."""
    tiling = _row_tiling(rows, hidden_size, nominal_chunk_columns(valid_columns, block_n), block_m)
    several = len(tiling.tiles(rows)) > 1
    return (
        4 * rows * hidden_size * want_hidden
        + 2 * tiling.rows * tiling.columns
        + 4 * tiling.columns * hidden_size * (several and want_weight)
    )


def row_groups(
    rows: int,
    hidden_size: int,
    valid_columns: int,
    want_hidden: bool,
    want_weight: bool,
    weight_sum_in_place: bool = False,
    *,
    block_m: int,
    block_n: int,
) -> list[slice]:
    """The backward's groups of rows (slices of the scored rows): one of every row, unless equal groups of
    about ROW_GROUP_ROWS (whole row blocks) need GROUPS_MIN_SAVING_BYTES less memory: their fp32 d_weight sum
    (when d_weight is wanted) plus one group's walk, against every row's walk (see the module docstring).
    weight_sum_in_place (d_weight added into an fp32 main_grad): equal groups whose walk fits IN_PLACE_WALK_BYTES.
    block_m, block_n: the gradient kernel's tile (groups are whole row blocks)."""
    in_place = weight_sum_in_place and want_weight
    if in_place:
        per_row = 4 * hidden_size * want_hidden + 2 * nominal_chunk_columns(valid_columns, block_n)
        group = max(block_m, IN_PLACE_WALK_BYTES // per_row // block_m * block_m)
    else:
        group = max(block_m, ROW_GROUP_ROWS // block_m * block_m)
    if rows <= group or not (want_hidden or in_place):
        return [slice(0, rows)]
    size = equal_piece_rows(rows, group, block_m)
    if in_place:
        return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]
    grouped = 4 * valid_columns * hidden_size * want_weight + _vocabulary_outside_bytes(
        size, hidden_size, valid_columns, want_hidden, False, block_m, block_n
    )
    if grouped + GROUPS_MIN_SAVING_BYTES > _vocabulary_outside_bytes(
        rows, hidden_size, valid_columns, want_hidden, want_weight, block_m, block_n
    ):
        return [slice(0, rows)]
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]
