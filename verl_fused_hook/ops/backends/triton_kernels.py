"""Every Triton kernel of the op; their launches are triton_backend.py's.

- `forward_statistics_kernel`: the vocab-tiled GEMM with a softmax-statistics epilogue (forward), optionally
  keeping the logits in fp16 for a gradient pass (the fused loss, and the two-pass op under keep_logits_bytes), or
  in fp32 as computed with each tile's and each 16-column group's max (token_log_probs' top-k and ids);
- `merge_tiles_kernel`: the forward's per-tile partials merged into one per row, in one launch;
- `grad_logits_kernel`: the same GEMM with a d_logits epilogue (the two-pass op's recomputing backward);
- `stored_grad_logits_kernel`: d_logits formed in place over the logits the forward kernel kept;
- `token_logits_kernel`, `sort_sparse_gradient_kernel`, `add_sparse_gradient_kernel`: `token_log_probs`' logits
  of given ids without top-k (a gather-dot in a fixed order over H) and the sparse part of its d_logits, sorted by
  column once, then added to each chunk the gradient kernel wrote;
- `top_k_kernel`: `token_log_probs`' exact top-k of a row from the kept fp32 logits and their tile and group maxima;
- `kept_rows_gradient_kernel`, `kept_columns_gradient_kernel`: `replayed_log_probs`' backward (its forward is the
  gather-dot): d_hidden as each row's weighted sum of its kept weight rows, and d_weight as each kept column's
  weighted sum of the hidden rows that kept it (entries sorted by column: one program owns a column's rows).

The two GEMM kernels compute a [BLOCK_M, BLOCK_N] tile of logits = hidden @ weight.T in
fp32 through TMA tensor descriptors (Hopper's bulk copy engine; out-of-bounds
rows and columns read as zero) and never write logits to memory unless asked to keep them. Rows are the
scored rows only (the caller compacts them); columns past `valid_columns` are
vocabulary padding: masked out in the forward, never stored in the backward.
Tile sizes are host-chosen constants (triton_backend.FORWARD_CONFIG and
GRAD_CONFIG) and no float atomics are used, so every launch is deterministic.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Finite stand-in for -inf: exp(NEG - m) is 0 and (NEG - m) * 0 is 0, so masked
# columns and the empty starting state never produce inf * 0 = NaN.
NEG = tl.constexpr(-1.0e30)
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
FP16_LOWEST = tl.constexpr(-65504.0)


@triton.jit
def _logits_tile(h_desc, w_desc, off_m, off_n, H, BLOCK_K: tl.constexpr, acc):
    """acc += hidden[off_m:+BM] @ weight[off_n:+BN].T, fp32 accumulation over H."""
    for k in range(0, H, BLOCK_K):
        a = h_desc.load([off_m, k])
        b = w_desc.load([off_n, k])
        acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a linear program id to (row block, column block) so that programs running
    together share GROUP_M row blocks and a few column blocks (both stay in L2)."""
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    return pid_m, pid_n


@triton.jit
def forward_statistics_kernel(
    h_desc,
    w_desc,  # [rows, H], [valid_columns, H] tensor descriptors
    label_col_ptr,  # int32 [rows]: label's column in this shard, -1 if elsewhere
    inv_temp_ptr,  # fp32 [rows]: 1 / temperature
    parts_ptr,  # fp32 [4 (SQUARES: 5), num_col_tiles, rows]: each column tile's max, sum, dot, label (, squares)
    store_desc,  # STORE: fp16 [rows, valid_columns] logits - tile max (RAW: fp32 logits, half-tile blocks)
    tile_max_ptr,  # STORE: fp32 [rows, num_col_tiles], each tile's row max
    group_max_desc,  # RAW: fp32 [rows, num_col_tiles x BLOCK_N / GROUP_N], each GROUP_N columns' max
    rows,
    H,
    valid_columns,
    num_col_tiles,
    tiles_per_split,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ENTROPY: tl.constexpr,
    STORE: tl.constexpr,
    SQUARES: tl.constexpr = False,  # also each tile's sum e^(2(z-m)), parts_ptr's fifth plane
    RAW: tl.constexpr = False,  # STORE in fp32 as computed, and the group maxima
    GROUP_N: tl.constexpr = 16,
):
    """One program: one row block against one contiguous split of column tiles. Each tile's logits are reduced to
    that tile's partial per row, (max m, sum e^(z-m), sum e^(z-m)(z-m), label logit), written to the tile's slot:
    nothing is carried from one tile to the next, so a row's partials are the same bits whatever split layout
    (chosen per row count, for speed) computed them, and `merge_tiles_kernel` adds them in an order fixed by the
    shard's width alone: the op is batch invariant without giving up the fastest layout.
    With SQUARES (token_log_probs' sum pi^2) also each tile's sum e^(2(z-m)).
    With STORE it also keeps the raw logits for a later gradient pass (the fused loss):
    each tile relative to its own row max, in fp16 (a difference <= 0 whose fp16 rounding
    is far below the bf16 rounding of d_logits), saturated at fp16's lowest value (where
    the probability is 0 anyway), and the tile's row max in fp32. With RAW as well, the raw
    logits themselves in fp32, the accumulator's exact values (token_log_probs' top-k and
    ids read them): stored as two [BLOCK_M, BLOCK_N / 2] halves through one staging buffer,
    since a whole fp32 tile's would not fit beside the pipeline in shared memory; and the max
    of each group of GROUP_N columns (`top_k_kernel` ranks tiles by their max, then their
    groups by theirs, before it reads any logit).

    The max is taken on the raw dot products a (z = a / T) and exponents in base 2, so each logit costs a max, a
    subtract, a multiply, an ex2 and two adds; a - max is exact for nearby values, so logits far from 0 (all near
    -1e4, say) keep their differences, and the max and the label logit are scaled by 1/T with the same single
    rounding, so a label that is the row's max cancels exactly in log p = z_y - m - log s.
    """
    pid_m, split = _grouped_tile(tl.program_id(0), tl.cdiv(rows, BLOCK_M), num_splits, GROUP_M)
    off_m = pid_m * BLOCK_M
    row_ids = off_m + tl.arange(0, BLOCK_M)
    row_ok = row_ids < rows
    label_col = tl.load(label_col_ptr + row_ids, mask=row_ok, other=-1)
    inv_temp = tl.load(inv_temp_ptr + row_ids, mask=row_ok, other=1.0)
    scale = inv_temp * LOG2E  # raw dot product -> base-2 logit

    plane = num_col_tiles * rows
    first_tile = split * tiles_per_split
    last_tile = tl.minimum(first_tile + tiles_per_split, num_col_tiles)
    for tile in range(first_tile, last_tile):
        off_n = tile * BLOCK_N
        acc = _logits_tile(h_desc, w_desc, off_m, off_n, H, BLOCK_K, tl.zeros((BLOCK_M, BLOCK_N), tl.float32))
        cols = off_n + tl.arange(0, BLOCK_N)
        if off_n + BLOCK_N > valid_columns:  # only the last tile holds padding columns
            acc = tl.where(cols[None, :] < valid_columns, acc, NEG)
        label_raw = tl.zeros((BLOCK_M,), tl.float32)
        # Most tiles hold no row's label (81% for 128 uniform labels over 594 tiles): skip their select and sum.
        if tl.max(((label_col >= off_n) & (label_col < off_n + BLOCK_N)).to(tl.int32), axis=0) > 0:
            label_raw = tl.sum(tl.where(cols[None, :] == label_col[:, None], acc, 0.0), axis=1)
        tile_max = tl.max(acc, axis=1)
        if STORE:
            if RAW:
                # Each store waits until the TMA has read every staging buffer written before it: the group maxima
                # and the left half go first (the last tile's stores long done), the right half after the softmax
                # sums below, which then cover the left half's read instead of a stall.
                group_max = tl.max(tl.reshape(acc, [BLOCK_M, BLOCK_N // GROUP_N, GROUP_N]), axis=2)
                group_max_desc.store([off_m, tile * (BLOCK_N // GROUP_N)], group_max)
                left, right = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N // 2]), [0, 2, 1]))
                store_desc.store([off_m, off_n], left)
            else:
                store_desc.store([off_m, off_n], tl.maximum(acc - tile_max[:, None], FP16_LOWEST).to(tl.float16))
            tl.store(tile_max_ptr + row_ids * num_col_tiles + tile, tile_max, mask=row_ok)
        shifted = (acc - tile_max[:, None]) * scale[:, None]  # exact difference first: no cancellation
        e = tl.exp2(shifted)
        dot = tl.sum(e * shifted, axis=1) * LN2 if ENTROPY else tl.zeros((BLOCK_M,), tl.float32)
        # the four values in one store (four stores, whose addresses stay live through the K loop, spill registers)
        # join appends its axis last: [[max, dot], [sum, label]] joined is max, sum, dot, label in memory order
        values = tl.join(tl.join(tile_max * inv_temp, dot), tl.join(tl.sum(e, axis=1), label_raw * inv_temp))
        where = parts_ptr + (tile * rows + row_ids)[:, None] + (tl.arange(0, 4) * plane)[None, :]
        tl.store(where, tl.reshape(values, [BLOCK_M, 4]), mask=row_ok[:, None])
        if SQUARES:
            tl.store(parts_ptr + 4 * plane + tile * rows + row_ids, tl.sum(e * e, axis=1), mask=row_ok)
        if STORE and RAW:
            store_desc.store([off_m, off_n + BLOCK_N // 2], right)


@triton.jit(do_not_specialize=["rows", "num_tiles", "tiles_per_program", "out_stride", "out_group_stride"])
def merge_tiles_kernel(
    parts_ptr,  # fp32 [PLANES, num_tiles, rows]: the forward kernel's max, sum, shifted dot, label logit (, square sum)
    out_ptr,  # fp32 [PLANES, groups, rows]: the same, merged over each program's tiles (squares: to the merged max)
    rows,
    num_tiles,
    tiles_per_program,
    out_stride,  # between out's planes
    out_group_stride,  # between out's groups (program_id(1))
    PLANES: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program: BLOCK_R rows over tiles_per_program consecutive tiles (group program_id(1)), with
    softmax_math.merge_partials' formulas, BLOCK_S tiles at a time folded into running sums rescaled to the running
    max (as the online softmax does). The launch (`triton_backend.merge_tiles`) merges groups of tiles first, then
    the groups, so the order a row's terms are added in is fixed by num_tiles (the shard's width) and the compiled
    layout alone: a row gets the same bits whatever rows share the call. Why the counts are never specialized:
    Triton compiles a variant for an integer divisible by 16, and on an H100 the one for 1024 rows laid the tile out
    over other threads (other bits than 777 rows gave). Slots past the group's tiles add exact zeros."""
    row_ids = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = row_ids < rows
    plane = num_tiles * rows
    group_first = tl.program_id(1) * tiles_per_program
    group_end = tl.minimum(group_first + tiles_per_program, num_tiles)
    run_max = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_R,), tl.float32)
    run_dot = tl.zeros((BLOCK_R,), tl.float32)
    run_label = tl.zeros((BLOCK_R,), tl.float32)
    run_square = tl.zeros((BLOCK_R,), tl.float32)
    for first in range(group_first, group_end, BLOCK_S):
        tile = first + tl.arange(0, BLOCK_S)
        inside = (tile[:, None] < group_end) & row_ok[None, :]
        offsets = tile[:, None] * rows + row_ids[None, :]
        part_max = tl.load(parts_ptr + offsets, mask=inside, other=float("-inf"))
        part_sum = tl.load(parts_ptr + plane + offsets, mask=inside, other=0.0)
        part_dot = tl.load(parts_ptr + 2 * plane + offsets, mask=inside, other=0.0)
        part_label = tl.load(parts_ptr + 3 * plane + offsets, mask=inside, other=0.0)
        new_max = tl.maximum(run_max, tl.max(part_max, axis=0))
        # what was summed so far, moved to the new max (nothing yet: exact zeros)
        had_mass = run_sum > 0
        old_shift = tl.where(had_mass, run_max - new_max, 0.0)  # <= 0
        old_rescale = tl.where(had_mass, tl.exp(old_shift), 0.0)
        has_mass = part_sum > 0
        shift = tl.where(has_mass, part_max - new_max[None, :], 0.0)
        rescale = tl.where(has_mass, tl.exp(shift), 0.0)
        # sum_j e^(z_j - M) (z_j - M) = rescale * (dot + (m - M) * sum) per part
        run_dot = old_rescale * (run_dot + old_shift * run_sum) + tl.sum(rescale * (part_dot + shift * part_sum), 0)
        if PLANES == 5:
            part_square = tl.load(parts_ptr + 4 * plane + offsets, mask=inside, other=0.0)
            run_square = run_square * (old_rescale * old_rescale) + tl.sum(part_square * (rescale * rescale), 0)
        run_sum = run_sum * old_rescale + tl.sum(part_sum * rescale, axis=0)
        run_label += tl.sum(part_label, axis=0)
        run_max = new_max
    out = out_ptr + tl.program_id(1) * out_group_stride + row_ids
    tl.store(out, run_max, mask=row_ok)
    tl.store(out + out_stride, run_sum, mask=row_ok)
    tl.store(out + 2 * out_stride, run_dot, mask=row_ok)
    tl.store(out + 3 * out_stride, run_label, mask=row_ok)
    if PLANES == 5:
        tl.store(out + 4 * out_stride, run_square, mask=row_ok)


@triton.jit
def grad_logits_kernel(
    h_desc,
    w_desc,
    dz_desc,  # [rows, H], [valid_columns, H], [rows, chunk] (output)
    label_col_ptr,
    inv_temp_ptr,  # int32 [rows], fp32 [rows]
    max_ptr,
    log_sum_ptr,
    shifted_mean_ptr,  # fp32 [rows], whole vocabulary: m, log sum e^(z-m), E[z] - m
    grad_lp_ptr,
    grad_ent_ptr,  # fp32 [rows]: upstream gradients
    rows,
    H,
    chunk_start,
    chunk_width,
    num_programs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """d_logits for one chunk of columns, written in the input dtype:
    dz_j = (g_lp * ([j == y] - p_j) + g_H * p_j * (E[z] - z_j)) / T.
    Persistent: `num_programs` programs walk the chunk's tiles, and the tile loop is flattened
    with the loop over H, so the next tile's loads are in flight during this tile's epilogue and
    store (on the H200 the kernel went from 1.07-1.31x to 0.97-1.09x a cuBLAS GEMM of its shape).
    Everything is taken relative to the row max first (d_j = z_j - m), so logits far
    from 0 lose no precision. Padding columns and rows past the end fall outside
    dz_desc and are not stored."""
    num_pid_m = tl.cdiv(rows, BLOCK_M)
    num_pid_n = tl.cdiv(chunk_width, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, num_programs, flatten=True):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = chunk_start + pid_n * BLOCK_N
        acc = _logits_tile(h_desc, w_desc, off_m, off_n, H, BLOCK_K, tl.zeros((BLOCK_M, BLOCK_N), tl.float32))
        row_ids = off_m + tl.arange(0, BLOCK_M)
        row_ok = row_ids < rows
        label_col = tl.load(label_col_ptr + row_ids, mask=row_ok, other=-1)
        inv_temp = tl.load(inv_temp_ptr + row_ids, mask=row_ok, other=1.0)
        row_max = tl.load(max_ptr + row_ids, mask=row_ok, other=0.0)
        log_sum2 = tl.load(log_sum_ptr + row_ids, mask=row_ok, other=0.0) * LOG2E
        shifted_mean = tl.load(shifted_mean_ptr + row_ids, mask=row_ok, other=0.0)
        g_lp = tl.load(grad_lp_ptr + row_ids, mask=row_ok, other=0.0) * inv_temp
        g_ent = tl.load(grad_ent_ptr + row_ids, mask=row_ok, other=0.0) * inv_temp
        shifted = acc * inv_temp[:, None] - row_max[:, None]
        p = tl.exp2(shifted * LOG2E - log_sum2[:, None])
        dz = p * (g_ent[:, None] * (shifted_mean[:, None] - shifted) - g_lp[:, None])
        cols = off_n + tl.arange(0, BLOCK_N)
        dz = tl.where(cols[None, :] == label_col[:, None], dz + g_lp[:, None], dz)
        dz_desc.store([off_m, off_n - chunk_start], dz.to(dz_desc.dtype))


@triton.jit
def stored_grad_logits_kernel(
    shifted_ptr,
    dz_ptr,
    stride_row,
    tile_max_ptr,
    tile_max_stride,
    label_col_ptr,
    inv_temp_ptr,
    max_ptr,
    log_sum_ptr,
    shifted_mean_ptr,
    grad_lp_ptr,
    grad_ent_ptr,
    columns,
    TILE_N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program per (row, block of columns): dz_j = (g_lp ([j == y] - p_j) + g_H p_j (E[z] - z_j)) / T,
    with z_j / T - max rebuilt as d_j / T + (tile max / T - max): the second term is exactly 0 in the tile
    holding the row max (both scaled with the same rounding), so no precision is lost to large logits."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < columns
    offsets = row.to(tl.int64) * stride_row + cols
    d = tl.load(shifted_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    tile_max = tl.load(tile_max_ptr + row.to(tl.int64) * tile_max_stride + cols // TILE_N, mask=ok, other=0.0)
    label_col = tl.load(label_col_ptr + row)
    inv_temp = tl.load(inv_temp_ptr + row)
    row_max = tl.load(max_ptr + row)
    log_sum2 = tl.load(log_sum_ptr + row) * LOG2E
    shifted_mean = tl.load(shifted_mean_ptr + row)
    g_lp = tl.load(grad_lp_ptr + row) * inv_temp
    g_ent = tl.load(grad_ent_ptr + row) * inv_temp
    shifted = d * inv_temp + (tile_max * inv_temp - row_max)
    p = tl.exp2(shifted * LOG2E - log_sum2)
    dz = p * (g_ent * (shifted_mean - shifted) - g_lp)
    dz = tl.where(cols == label_col, dz + g_lp, dz)
    tl.store(dz_ptr + offsets, dz.to(dz_ptr.dtype.element_ty), mask=ok)


@triton.jit
def token_logits_kernel(
    h_ptr,
    h_stride,
    w_ptr,
    w_stride,  # [rows, H], [valid_columns, H]
    columns_ptr,
    inv_temp_ptr,
    out_ptr,  # int64 [rows, entries] (-1: not on this shard), fp32 [rows], fp32 [rows, entries]
    entries,
    H,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One program: one row's `BLOCK_T` entries, z = h . W[column] / T in fp32 (0 where the column is -1). The sum
    over H runs in BLOCK_H pieces in order, each a fixed tree, so a logit depends on its row and column alone (no
    other row, no batch size): the bitwise batch invariance token_log_probs promises."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = j < entries
    column = tl.load(columns_ptr + row * entries + j, mask=ok, other=-1)
    present = ok & (column >= 0)
    acc = tl.zeros((BLOCK_T,), tl.float32)
    for start in range(0, H, BLOCK_H):
        k = start + tl.arange(0, BLOCK_H)
        k_ok = k < H
        h = tl.load(h_ptr + row * h_stride + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + column.to(tl.int64)[:, None] * w_stride + k[None, :],
            mask=present[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(w * h[None, :], axis=1)
    z = acc * tl.load(inv_temp_ptr + row)
    tl.store(out_ptr + row * entries + j, tl.where(present, z, 0.0), mask=ok)


@triton.jit
def sort_sparse_gradient_kernel(
    columns_ptr,
    coefficients_ptr,  # int64 / fp32 [rows, entries]: a row's columns (-1: none; repeats allowed), coefficients
    entries,
    out_columns_ptr,
    out_coefficients_ptr,  # int32 / fp32 [rows, entries]: by column, repeats summed onto the first (the rest -1, 0)
    bounds_ptr,  # int32 [rows, chunks + 1]: where each vocabulary chunk's entries begin in the sorted row
    chunk_width,
    chunks,
    BLOCK: tl.constexpr,  # a power of two >= entries
):
    """One program per row: its entries sorted by column (equal columns in their order), each run of equal columns
    summed onto its first entry in the order of token_math.combine_duplicate_columns (a suffix scan doubling its
    step: the same bits), and where each chunk of `chunk_width` columns begins, so that the gradient kernel's
    chunks each read only their own entries."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    ok = j < entries
    column = tl.load(columns_ptr + row * entries + j, mask=ok, other=-1)
    key = tl.where(ok, ((column + 1) << 24) | j, 0x7FFFFFFFFFFFFFFF)
    key = tl.sort(key)
    sorted_column = (key >> 24) - 1
    sums = tl.load(coefficients_ptr + row * entries + (key & 0xFFFFFF), mask=ok, other=0.0)
    step = 1
    while step < entries:
        later = tl.minimum(j + step, BLOCK - 1)
        same_run = (j + step < entries) & (tl.gather(sorted_column, later, 0) == sorted_column)
        sums = tl.where(same_run, sums + tl.gather(sums, later, 0), sums)
        step *= 2
    before = tl.gather(sorted_column, tl.maximum(j - 1, 0), 0)
    owner = ok & (sorted_column >= 0) & ((j == 0) | (before != sorted_column))
    tl.store(out_columns_ptr + row * entries + j, tl.where(owner, sorted_column, -1).to(tl.int32), mask=ok)
    tl.store(out_coefficients_ptr + row * entries + j, tl.where(owner, sums + 0.0, 0.0), mask=ok)
    for chunk in range(0, chunks + 1):
        below = tl.sum((ok & (sorted_column < chunk * chunk_width)).to(tl.int32), axis=0)
        tl.store(bounds_ptr + row * (chunks + 1) + chunk, below)


@triton.jit
def add_sparse_gradient_kernel(
    dz_ptr,
    dz_stride,  # [rows, chunk_width] d_logits of one vocabulary chunk (the input dtype)
    columns_ptr,
    coefficients_ptr,  # int32 / fp32 [rows, entries]: sort_sparse_gradient_kernel's sorted, unique entries
    bounds_ptr,  # int32 [rows, bounds_stride]: its chunk bounds
    bounds_stride,
    inv_temp_ptr,  # fp32 [rows]
    entries,
    chunk,
    chunk_start,
    BLOCK: tl.constexpr,
):
    """One program per row: dz[column - chunk_start] += coefficient / T for the row's entries of this chunk (between
    its two bounds). The columns are unique per row, so no two lanes touch one element: no atomics, and the result
    has no order."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.load(bounds_ptr + row * bounds_stride + chunk)
    last = tl.load(bounds_ptr + row * bounds_stride + chunk + 1)
    inv_temp = tl.load(inv_temp_ptr + row)
    for start in range(first, last, BLOCK):
        j = start + tl.arange(0, BLOCK)
        column = tl.load(columns_ptr + row * entries + j, mask=j < last, other=-1)
        inside = column >= 0
        add = tl.load(coefficients_ptr + row * entries + j, mask=inside, other=0.0) * inv_temp
        where = dz_ptr + row * dz_stride + (column - chunk_start)
        old = tl.load(where, mask=inside, other=0.0).to(tl.float32)
        tl.store(where, (old + add).to(dz_ptr.dtype.element_ty), mask=inside)


@triton.jit
def kept_rows_gradient_kernel(
    d_ptr,
    columns_ptr,  # fp32 / int64 [rows, entries] d_logits of the kept entries; their columns (-1: not on this shard)
    w_ptr,
    w_stride,
    out_ptr,
    out_stride,
    out_rows_ptr,  # [N, H] d_hidden (its dtype), int64 [rows] the row of out each row's gradient goes to
    entries,
    H,
    BLOCK_H: tl.constexpr,
):
    """One program: BLOCK_H hidden units of one row, sum_j d_j W[column_j] over the row's entries in order, rounded
    once into the row's place in d_hidden: a row's gradient depends on its own entries alone (batch invariant), and
    no two programs write one element."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    k_ok = k < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in range(0, entries):
        column = tl.load(columns_ptr + row * entries + j)
        d = tl.load(d_ptr + row * entries + j)
        w = tl.load(w_ptr + column * w_stride + k, mask=k_ok & (column >= 0), other=0.0).to(tl.float32)
        acc += d * w
    tl.store(out_ptr + tl.load(out_rows_ptr + row) * out_stride + k, acc.to(out_ptr.dtype.element_ty), mask=k_ok)


@triton.jit
def kept_columns_gradient_kernel(
    entry_rows_ptr,
    entry_d_ptr,  # int64 / fp32 [E] the entries sorted by column (stable: rows in order): hidden row, d_logit
    segment_start_ptr,
    segment_column_ptr,  # int64 [S + 1] each column's first entry (and the end), int64 [S] the column
    h_ptr,
    h_stride,
    out_ptr,
    out_stride,  # [V_local, H]: the returned d_weight, or a main_grad added into
    H,
    ACCUMULATE: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One program: BLOCK_H units of one kept column's d_weight row, sum over the column's entries (in row order) of
    d * h[row]; written once (or added once onto main_grad): no atomics, no order between programs."""
    segment = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    k_ok = k < H
    start = tl.load(segment_start_ptr + segment)
    stop = tl.load(segment_start_ptr + segment + 1)
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for e in range(start, stop):
        row = tl.load(entry_rows_ptr + e)
        acc += tl.load(entry_d_ptr + e) * tl.load(h_ptr + row * h_stride + k, mask=k_ok, other=0.0).to(tl.float32)
    where = out_ptr + tl.load(segment_column_ptr + segment) * out_stride + k
    if ACCUMULATE:
        acc += tl.load(where, mask=k_ok, other=0.0).to(tl.float32)
    tl.store(where, acc.to(out_ptr.dtype.element_ty), mask=k_ok)


@triton.jit
def _order_keys(x):
    """fp32 -> uint32 in x's order (-0.0 as +0.0; 0 stays free for "no value"): the top-k compares integers."""
    bits = (x + 0.0).to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _first_largest(keys, n):
    """Mask of exactly n of `keys` (uint32, 0 where empty; n at most the non-empty ones): those above the n-th
    largest, then the ones equal to it by lower position. A search one bit at a time from the top for the largest t
    that at least n keys reach, stopped as soon as exactly n reach it (they are the n largest then): 8-25 of the 32
    steps, each a reduction over the block, on random logits at k = 32-128 (ties at the n-th run all 32)."""
    found = tl.max(tl.zeros_like(keys), axis=0)
    reach = n + 1  # keys reaching `found`, once a step has counted them; n + 1 before: not known to be exactly n
    bit = 0
    while (bit < 32) & (reach != n):  # a loop, not unrolled: a program's code stays small beside others in the SM
        trial = found | (tl.full([], 0x80000000, tl.uint32) >> tl.cast(bit, tl.uint32))
        count = tl.sum((keys >= trial).to(tl.int32), axis=0)
        found = tl.where(count >= n, trial, found)
        reach = tl.where(count >= n, count, reach)
        bit += 1
    above = keys > found
    tie = (keys == found).to(tl.int32)
    room = n - tl.sum(above.to(tl.int32), axis=0)
    return above | ((tie != 0) & (tl.cumsum(tie, axis=0) - tie < room))


@triton.jit(do_not_specialize=["tiles", "valid_columns", "wanted", "vocab_start", "tokens"])
def top_k_kernel(
    raw_ptr,  # fp32 [rows, raw_stride]: the forward kernel's kept logits (RAW), valid_columns of each row
    raw_stride,
    token_columns_ptr,  # int64 [rows, tokens]: asked columns, -1 where none (read when TOKENS_BLOCK > 0)
    token_logits_ptr,  # fp32 [rows, tokens]: their logits z = raw / T, 0 where the column is -1
    tokens,
    tile_max_ptr,  # fp32 [rows, tile_stride]: each tile's max, `tiles` a row
    tile_stride,
    group_max_ptr,  # fp32 [rows, group_stride]: each GROUP columns' max, PER_TILE groups a tile
    group_stride,
    inv_temp_ptr,  # fp32 [rows]
    scratch_ptr,  # int32 [rows, BLOCK_K]: each row's picks between the steps
    values_ptr,  # fp32 [rows, out_stride]: the row's top `wanted` logits z = raw / T, highest first
    ids_ptr,  # int64 [rows, out_stride]: their ids (column + vocab_start)
    out_stride,
    tiles,
    valid_columns,
    wanted,
    vocab_start,
    GROUP: tl.constexpr,
    PER_TILE: tl.constexpr,
    BLOCK_T: tl.constexpr,  # a power of two >= tiles
    BLOCK_K: tl.constexpr,  # a power of two >= wanted
    TOKENS_BLOCK: tl.constexpr,  # asked columns read at once; 0: none asked
):
    """One program: one row's top `wanted` logits of its shard, exact, equal logits by lower column first (so the set
    depends on the row alone), ordered as token_math.select_top orders them. The wanted largest lie in the `wanted`
    groups of largest max, and those in the `wanted` tiles of largest max (a tile or group left out holds nothing
    above the maxima of those picked; on equal maxima the lower one holds the lower columns), so the program ranks
    the row's tile maxima, then the picked tiles' group maxima, then the picked groups' logits: at k = 128 of
    151936 columns 594, 2048 and 2048 values, each by a bitwise search (`_first_largest`) in registers, each read
    in one load. The asked ids' logits (distillation's teacher ids) are read here too, saving a chunk's five
    elementwise launches."""
    row = tl.program_id(0).to(tl.int64)
    inv_temp = tl.load(inv_temp_ptr + row)

    picks = scratch_ptr + row * BLOCK_K
    tile = tl.arange(0, BLOCK_T)
    maxima = tl.load(tile_max_ptr + row * tile_stride + tile, mask=tile < tiles)
    picked_tiles = tl.minimum(wanted, tiles)
    picked = _first_largest(tl.where(tile < tiles, _order_keys(maxima), 0), picked_tiles)
    tl.store(picks + tl.cumsum(picked.to(tl.int32), axis=0) - 1, tile, mask=picked)
    tl.debug_barrier()

    entry = tl.arange(0, BLOCK_K * PER_TILE)  # the picked tiles' groups, in column order
    in_tile = entry // PER_TILE < picked_tiles
    group = tl.load(picks + entry // PER_TILE, mask=in_tile, other=0) * PER_TILE + entry % PER_TILE
    maxima = tl.load(group_max_ptr + row * group_stride + group, mask=in_tile)
    picked_groups = tl.minimum(wanted, picked_tiles * PER_TILE)
    picked = _first_largest(tl.where(in_tile, _order_keys(maxima), 0), picked_groups)
    tl.debug_barrier()  # every thread has read the tiles before they are overwritten
    tl.store(picks + tl.cumsum(picked.to(tl.int32), axis=0) - 1, group, mask=picked)
    tl.debug_barrier()

    entry = tl.arange(0, BLOCK_K * GROUP)  # the picked groups' columns, in column order
    in_group = entry // GROUP < picked_groups
    columns = tl.load(picks + entry // GROUP, mask=in_group, other=0) * GROUP + entry % GROUP
    inside = in_group & (columns < valid_columns)
    raw = tl.load(raw_ptr + row * raw_stride + columns, mask=inside, other=0.0)
    picked = _first_largest(tl.where(inside, _order_keys(raw), 0), wanted)
    tl.debug_barrier()
    tl.store(picks + tl.cumsum(picked.to(tl.int32), axis=0) - 1, columns, mask=picked)
    tl.debug_barrier()

    slot = tl.arange(0, BLOCK_K)
    kept = slot < wanted
    column = tl.load(picks + slot, mask=kept, other=0)
    z = tl.load(raw_ptr + row * raw_stride + column, mask=kept, other=0.0) * inv_temp
    order = (_order_keys(z).to(tl.uint64) << 32) | (column.to(tl.uint32) ^ 0xFFFFFFFF).to(tl.uint64)
    order = tl.sort(tl.where(kept, order, 0), descending=True)
    column = ((order & 0xFFFFFFFF).to(tl.uint32) ^ 0xFFFFFFFF).to(tl.int32)
    z = tl.load(raw_ptr + row * raw_stride + column, mask=kept, other=0.0) * inv_temp
    tl.store(values_ptr + row * out_stride + slot, z, mask=kept)
    tl.store(ids_ptr + row * out_stride + slot, column.to(tl.int64) + vocab_start, mask=kept)
    if TOKENS_BLOCK > 0:
        for start in range(0, tokens, TOKENS_BLOCK):
            token = start + tl.arange(0, TOKENS_BLOCK)
            asked = token < tokens
            asked_column = tl.load(token_columns_ptr + row * tokens + token, mask=asked, other=-1)
            held = asked_column >= 0
            asked_raw = tl.load(raw_ptr + row * raw_stride + asked_column, mask=held, other=0.0)
            tl.store(token_logits_ptr + row * tokens + token, tl.where(held, asked_raw * inv_temp, 0.0), mask=asked)
