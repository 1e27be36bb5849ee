"""Hopper (sm_90) warp-specialized forward in Gluon: each [64, 256] tile of logits reduced to its per-row partials
(max, sum, shifted dot, label logit; with SQUARES also sum e^(2(z-m))), as triton_kernels.forward_statistics_kernel
writes them, and with RAW the tile's fp32 logits as computed, its row max and its 16-column groups' maxima
(token_log_probs' top-k and ids read them). Only the fp16 kept logits of the fused loss stay Triton's.

Why: Triton's kernel runs a tile's softmax epilogue (an exponential, a max, two sums per logit, the partials' store)
after the tile's K loop on the same warps, so the tensor cores idle through it; on an H100 the forward took
1.09-1.27x one GEMM at N >= 4096 (issue 55), the GEMM's clock included. Here one producer warp issues the TMA loads
into a ring of stages and two consumer warpgroups share each [128, 256] tile, one [64, 256] half each: both read the
stage's one weight tile, so a multiply-add costs the L2 2/3 of the bytes it cost when each consumer took a tile of
its own (the kernel's first form, ping-pong: 3-6% slower at 12288-24576 rows on an H100). The second consumer starts
two K steps behind the first, so that their epilogues meet the other's wgmmas rather than each other (the ring, four
steps deep, bounds how far apart they can drift). A consumer's [64, 256] half puts a row's 256 logits in the same
threads and registers as the Triton kernel's 8-warp [128, 256] tile (NVMMA v3, warps [4, 1] against [8, 1],
instruction [16, 256, 16]), and the epilogue is the same formula in the same order, so each tile's partials are the
same bits (tests/gpu/test_gluon_forward.py), and so are the kept fp32 logits and their maxima: the top-k and the
ids' logits read the same values whichever kernel ran.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

NEG = gl.constexpr(-1.0e30)  # triton_kernels.NEG: the padding columns' logit
LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 256, 64
# 4 stages of two [64, 64] hidden tiles and a [256, 64] weight tile: 192 KiB of the 227 KiB a block may have.
STAGES = gl.constexpr(4)
# RAW: each consumer stages its kept logits through one [64, 32] fp32 buffer (eight TMA stores a tile) and its group
# maxima through one [64, 16]: 24 KiB beside the ring, where a [64, 64] staging buffer would not fit.
RAW_COLUMNS, GROUP_COLUMNS = 32, 16
# K steps the second consumer starts behind the first (1 and 3 timed the same on an H100, within the A/B's noise)
STAGGER = gl.constexpr(2)
# Programs running together (132 of them) share GROUP_M row blocks of 128 and take about four column tiles (16 blocks
# timed the same on an H100).
GROUP_M = gl.constexpr(32)
# A consumer's [64, 256] fp32 accumulator is 128 registers a thread; 232 leave the epilogue room. The kernel's
# 12 warps (two consumers and the loader's warpgroup) start at 168 registers each and trade them at the split.
CONSUMER_REGS, LOADER_REGS = gl.constexpr(232), gl.constexpr(40)
MAX_REGS = 168


@gluon.jit
def _tile(local, num_pid_m, num_pid_n):
    """This program's `local`-th tile (programs stride the tiles), grouped: tiles taken together share GROUP_M row
    blocks."""
    tile = gl.program_id(0) + local * gl.num_programs(0)
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    group_size = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % width) % group_size, (tile % width) // group_size


@gluon.jit
def _tile_count(num_pid_m, num_pid_n):
    return gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), gl.num_programs(0))


@gluon.jit
def _load_partition(h_desc, w_desc, a_bufs, b_bufs, ready, empty, rows, hidden_size, num_col_tiles):
    """Producer: every K step of each of the program's tiles, in order, into the next free stage of the ring: the
    tile's two [BM, BK] hidden tiles (one a consumer) and the [BN, BK] weight tile both consumers read."""
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BK: gl.constexpr = h_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    nbytes: gl.constexpr = 2 * h_desc.block_type.nbytes + w_desc.block_type.nbytes
    num_pid_m = gl.cdiv(rows, 2 * BM)
    k_steps = gl.cdiv(hidden_size, BK)
    for local in range(_tile_count(num_pid_m, num_col_tiles)):
        pid_m, pid_n = _tile(local, num_pid_m, num_col_tiles)
        for kk in range(k_steps):
            pos = local * k_steps + kk
            stage = pos % STAGES
            mbarrier.wait(empty.index(stage), ((pos // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), nbytes)
            tma.async_copy_global_to_shared(
                h_desc, [pid_m * 2 * BM, kk * BK], ready.index(stage), a_bufs.index(2 * stage)
            )
            tma.async_copy_global_to_shared(
                h_desc, [pid_m * 2 * BM + BM, kk * BK], ready.index(stage), a_bufs.index(2 * stage + 1)
            )
            tma.async_copy_global_to_shared(w_desc, [pid_n * BN, kk * BK], ready.index(stage), b_bufs.index(stage))


@gluon.jit
def _mainloop(a_bufs, b_bufs, ready, empty, start, acc, local, k_steps, ROLE: gl.constexpr):
    """acc = this consumer's hidden tile @ the weight tile.T over the tile's K steps, one wgmma in flight, each stage
    released once read (a stage is free again when both consumers have released it). The second consumer starts
    STAGGER steps after the first, so that one's epilogue meets the other's wgmmas, not its epilogue."""
    if ROLE == 1:
        if local == 0:
            mbarrier.wait(start.index(0), 0)
    base = local * k_steps
    previous = base % STAGES
    for kk in range(k_steps):
        if ROLE == 0:
            if local == 0:
                if kk == gl.minimum(STAGGER, k_steps - 1):
                    mbarrier.arrive(start.index(0), count=1)
        pos = base + kk
        stage = pos % STAGES
        mbarrier.wait(ready.index(stage), (pos // STAGES) & 1)
        acc = warpgroup_mma(
            a_bufs.index(2 * stage + ROLE), b_bufs.index(stage).permute((1, 0)), acc, use_acc=kk > 0, is_async=True
        )
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index(previous), count=1, pred=kk > 0)
        previous = stage
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(previous), count=1)
    return acc


@gluon.constexpr_function
def _mma_layout(BN):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])


@gluon.jit
def _halves(x):
    """A [rows, W] register tile's columns [0, W/2) and [W/2, W): the same registers, relabelled."""
    BM: gl.constexpr = x.shape[0]
    W: gl.constexpr = x.shape[1]
    return gl.split(gl.permute(gl.reshape(x, [BM, 2, W // 2]), [0, 2, 1]))


@gluon.jit
def _store_staged(desc, buf, value, off_m, off_n):
    """value -> global [off_m, off_n] through the shared buffer `buf` by TMA, once the buffer's last store read it."""
    tma.store_wait(0)
    buf.store(value)
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, [off_m, off_n], buf)


@gluon.jit
def _store_quarter(raw_desc, raw_buf, quarter, off_m, off_n):
    """A [64, 64] quarter of the tile's logits as two [64, 32] TMA stores (RAW_COLUMNS)."""
    left, right = _halves(quarter)
    _store_staged(raw_desc, raw_buf, left, off_m, off_n)
    _store_staged(raw_desc, raw_buf, right, off_m, off_n + raw_desc.block_type.shape[1])


@gluon.jit
def _statistics_consumer(
    h_desc, w_desc, a_bufs, b_bufs, ready, empty, start, label_col_ptr, inv_temp_ptr, parts_ptr,
    kept, rows, hidden_size, valid_columns, num_col_tiles, ENTROPY: gl.constexpr, SQUARES: gl.constexpr,
    RAW: gl.constexpr, ROLE: gl.constexpr,
):  # fmt: skip
    """One half of each of the program's tiles (ROLE: which 64 rows): its mainloop, then
    forward_statistics_kernel's epilogue, operation for operation (see there why each step is as it is). With RAW
    the tile's row max, group maxima and logits go out before the softmax sums: a store waits only for the TMA's read
    of the staging buffer, and the other consumer's wgmmas keep the tensor cores busy meanwhile."""
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    layout: gl.constexpr = _mma_layout(BN)
    row_layout: gl.constexpr = gl.SliceLayout(1, layout)
    num_pid_m = gl.cdiv(rows, 2 * BM)
    k_steps = gl.cdiv(hidden_size, h_desc.block_type.shape[1])
    plane = num_col_tiles * rows
    for local in range(_tile_count(num_pid_m, num_col_tiles)):
        pid_m, pid_n = _tile(local, num_pid_m, num_col_tiles)
        acc = gl.zeros((BM, BN), gl.float32, layout)
        acc = _mainloop(a_bufs, b_bufs, ready, empty, start, acc, local, k_steps, ROLE)
        off_m = (2 * pid_m + ROLE) * BM
        off_n = pid_n * BN
        row_ids = off_m + gl.arange(0, BM, layout=row_layout)
        row_ok = row_ids < rows
        label_col = gl.load(label_col_ptr + row_ids, mask=row_ok, other=-1)
        inv_temp = gl.load(inv_temp_ptr + row_ids, mask=row_ok, other=1.0)
        scale = inv_temp * LOG2E
        cols = gl.expand_dims(off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, layout)), 0)
        if off_n + BN > valid_columns:
            acc = gl.where(cols < valid_columns, acc, NEG)
        label_raw = gl.zeros((BM,), gl.float32, row_layout)
        if gl.max(((label_col >= off_n) & (label_col < off_n + BN)).to(gl.int32), axis=0) > 0:
            label_raw = gl.sum(gl.where(cols == gl.expand_dims(label_col, 1), acc, 0.0), axis=1)
        tile_max = gl.max(acc, axis=1)
        if RAW:
            raw_desc, raw_bufs, tile_max_ptr, group_max_desc, group_bufs = kept
            raw_buf = raw_bufs.index(ROLE)
            gl.store(tile_max_ptr + row_ids * num_col_tiles + pid_n, tile_max, mask=row_ok)
            GROUPS: gl.constexpr = group_max_desc.block_type.shape[1]
            group_max = gl.max(gl.reshape(acc, [BM, GROUPS, BN // GROUPS]), axis=2)
            _store_staged(group_max_desc, group_bufs.index(ROLE), group_max, off_m, pid_n * GROUPS)
            left, right = _halves(acc)
            first, second = _halves(left)
            _store_quarter(raw_desc, raw_buf, first, off_m, off_n)
            _store_quarter(raw_desc, raw_buf, second, off_m, off_n + BN // 4)
            third, fourth = _halves(right)
            _store_quarter(raw_desc, raw_buf, third, off_m, off_n + BN // 2)
            _store_quarter(raw_desc, raw_buf, fourth, off_m, off_n + 3 * (BN // 4))
        shifted = (acc - gl.expand_dims(tile_max, 1)) * gl.expand_dims(scale, 1)
        e = gl.exp2(shifted)
        if ENTROPY:
            dot = gl.sum(e * shifted, axis=1) * LN2
        else:
            dot = gl.zeros((BM,), gl.float32, row_layout)
        where = parts_ptr + pid_n * rows + row_ids
        gl.store(where, tile_max * inv_temp, mask=row_ok)
        gl.store(where + plane, gl.sum(e, axis=1), mask=row_ok)
        gl.store(where + 2 * plane, dot, mask=row_ok)
        gl.store(where + 3 * plane, label_raw * inv_temp, mask=row_ok)
        if SQUARES:
            gl.store(where + 4 * plane, gl.sum(e * e, axis=1), mask=row_ok)
    if RAW:
        tma.store_wait(0)


@gluon.jit
def _barriers():
    """Per stage: `ready` (its loads landed) and `empty` (both consumers' wgmmas read it); `start`: the second
    consumer's go."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    start = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    mbarrier.init(start.index(0), count=1)
    return ready, empty, start


@gluon.jit
def tile_partials_kernel(
    h_desc, w_desc,  # [rows, H], [valid_columns, H] bf16
    label_col_ptr, inv_temp_ptr,  # int32 [rows] (-1: the label is on another shard), fp32 [rows]
    parts_ptr,  # fp32 [4 (SQUARES: 5), num_col_tiles, rows]: each column tile's max, sum, dot, label (, squares)
    raw_desc,  # RAW: fp32 [rows, valid_columns] logits as computed, [BLOCK_M, RAW_COLUMNS] blocks
    tile_max_ptr,  # RAW: fp32 [rows, num_col_tiles], each tile's row max
    group_max_desc,  # RAW: fp32 [rows, num_col_tiles x BLOCK_N / GROUP_COLUMNS], each group's max
    rows, hidden_size, valid_columns, num_col_tiles,
    ENTROPY: gl.constexpr,
    SQUARES: gl.constexpr = False,
    RAW: gl.constexpr = False,
):  # fmt: skip
    """Persistent: each program strides the [2 BLOCK_M, BLOCK_N] tiles, each consumer taking one half of every tile."""
    a_bufs = gl.allocate_shared_memory(h_desc.dtype, [2 * STAGES] + h_desc.block_type.shape, h_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    kept = ()  # a partition's arguments are IR values: without RAW none
    if RAW:
        raw_bufs = gl.allocate_shared_memory(gl.float32, [2] + raw_desc.block_type.shape, raw_desc.layout)
        group_bufs = gl.allocate_shared_memory(gl.float32, [2] + group_max_desc.block_type.shape, group_max_desc.layout)
        kept = (raw_desc, raw_bufs, tile_max_ptr, group_max_desc, group_bufs)
    ready, empty, start = _barriers()
    gl.warp_specialize(
        [
            (_statistics_consumer, (h_desc, w_desc, a_bufs, b_bufs, ready, empty, start, label_col_ptr, inv_temp_ptr,
                                    parts_ptr, kept, rows, hidden_size, valid_columns, num_col_tiles, ENTROPY,
                                    SQUARES, RAW, 0)),
            (_statistics_consumer, (h_desc, w_desc, a_bufs, b_bufs, ready, empty, start, label_col_ptr, inv_temp_ptr,
                                    parts_ptr, kept, rows, hidden_size, valid_columns, num_col_tiles, ENTROPY,
                                    SQUARES, RAW, 1)),
            (_load_partition, (h_desc, w_desc, a_bufs, b_bufs, ready, empty, rows, hidden_size, num_col_tiles)),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip


# The tiles' shared-memory layouts, made once: host time before the launch is GPU idle time at small N.
_HIDDEN_LAYOUT = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], gl.bfloat16)
_WEIGHT_LAYOUT = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], gl.bfloat16)
_RAW_LAYOUT = gl.NVMMASharedLayout.get_default_for([BLOCK_M, RAW_COLUMNS], gl.float32)
_GROUP_LAYOUT = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N // GROUP_COLUMNS], gl.float32)


def weight_descriptor(weight: torch.Tensor) -> TensorDescriptor:
    """The [valid_columns, H] bf16 weight as tile_partials reads it: made once per forward, reused by each launch."""
    return TensorDescriptor.from_tensor(weight, [BLOCK_N, BLOCK_K], _WEIGHT_LAYOUT)


def tile_partials(
    hidden: torch.Tensor,
    w_desc: TensorDescriptor,
    valid_columns: int,
    label_col: torch.Tensor,
    inv_temp: torch.Tensor,
    parts: torch.Tensor,
    entropy: bool,
    programs: int,
    kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """parts (fp32 [4 or 5, column tiles, rows], contiguous; 5: with the square sums) <- each column tile's partials
    of `hidden`'s rows (bf16 [rows, H], TMA-ready), on at most `programs` persistent programs (one an SM). `kept`:
    (raw fp32 [rows, valid_columns] with 16-byte aligned rows, tile maxima [rows, column tiles], group maxima [rows,
    column tiles x BLOCK_N / GROUP_COLUMNS]) written as well."""
    rows, hidden_size = hidden.shape
    col_tiles = parts.shape[1]
    stores = (None, None, None)
    if kept is not None:
        raw, tile_max, group_max = kept
        stores = (
            TensorDescriptor.from_tensor(raw, [BLOCK_M, RAW_COLUMNS], _RAW_LAYOUT),
            tile_max,
            TensorDescriptor.from_tensor(group_max, [BLOCK_M, BLOCK_N // GROUP_COLUMNS], _GROUP_LAYOUT),
        )
    grid = (max(1, min(triton.cdiv(rows, 2 * BLOCK_M) * col_tiles, programs)),)
    tile_partials_kernel[grid](
        TensorDescriptor.from_tensor(hidden, [BLOCK_M, BLOCK_K], _HIDDEN_LAYOUT), w_desc, label_col, inv_temp, parts,
        *stores, rows, hidden_size, valid_columns, col_tiles, ENTROPY=entropy, SQUARES=parts.shape[0] == 5,
        RAW=kept is not None, num_warps=4, maxnreg=MAX_REGS,
    )  # fmt: skip
