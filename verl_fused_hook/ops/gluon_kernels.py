"""Hopper (sm90) ping-pong d_logits kernel in Gluon for the two-pass backward: the logits of one
vocabulary chunk recomputed, then the d_logits epilogue, as triton_kernels.grad_logits_kernel.

Why: Triton's kernel runs each tile's epilogue after its mainloop on the same warps, so the tensor
cores idle while a tile's exponentials, per-row loads and store run. Here one producer warp issues
TMA loads into a ring of stages and two consumer warpgroups take turns at the tensor cores, each on
its own [128, 128] tile: one's epilogue runs while the other's mainloop does. Same formula and order
of operations as the Triton kernel, so the same bits; fixed tiles and no atomics, so deterministic.
On the H200 (Triton 3.6, per 8192-column chunk) it took 0.99-1.03x a cuBLAS GEMM of the chunk's shape
where the Triton kernel took 0.99-1.08x (docs/op.md). A d_hidden kernel of the same design that read
the fp32 accumulator before its turn was 1.27-1.39x cuBLAS's addmm (three stages: the fp32 tiles take
the shared memory of the fourth) and is not used.
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

LOG2E = gl.constexpr(1.4426950408889634)
BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 64
STAGES = gl.constexpr(4)  # 4 x 32 KiB of operands, plus 2 x 32 KiB of d_logits tiles on their way out
GROUP_M = gl.constexpr(8)
# One consumer warpgroup's [128, 128] fp32 accumulator is 128 registers a thread; 232 leave room for the
# epilogue. The kernel's 12 warps (2 consumers, the loader's warpgroup) share 168 x 384 registers.
CONSUMER_REGS, LOADER_REGS = gl.constexpr(232), gl.constexpr(40)
MAX_REGS = 168


@gluon.jit
def _tile(local, num_pid_m, num_pid_n, GROUP: gl.constexpr):
    """This program's `local`-th output tile (programs stride the tiles), grouped so that programs running
    together share GROUP row blocks (kept in L2)."""
    tile = gl.program_id(0) + local * gl.num_programs(0)
    width = GROUP * num_pid_n
    first_m = (tile // width) * GROUP
    group_size = gl.minimum(num_pid_m - first_m, GROUP)
    return first_m + (tile % width) % group_size, (tile % width) // group_size


@gluon.jit
def _tile_count(num_pid_m, num_pid_n):
    return gl.cdiv(num_pid_m * num_pid_n - gl.program_id(0), gl.num_programs(0))


@gluon.jit
def _load_partition(h_desc, w_desc, a_bufs, b_bufs, ready, empty, rows, hidden_size, chunk_start, chunk_width):
    """Producer: for each of the program's tiles, every K step's hidden tile [BM, BK] and weight tile [BN, BK]
    into the next free stage of the ring."""
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BK: gl.constexpr = h_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    nbytes: gl.constexpr = h_desc.block_type.nbytes + w_desc.block_type.nbytes
    num_pid_m = gl.cdiv(rows, BM)
    num_pid_n = gl.cdiv(chunk_width, BN)
    k_steps = gl.cdiv(hidden_size, BK)
    for local in range(_tile_count(num_pid_m, num_pid_n)):
        pid_m, pid_n = _tile(local, num_pid_m, num_pid_n, GROUP_M)
        for kk in range(k_steps):
            pos = local * k_steps + kk
            stage = pos % STAGES
            mbarrier.wait(empty.index(stage), ((pos // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), nbytes)
            tma.async_copy_global_to_shared(h_desc, [pid_m * BM, kk * BK], ready.index(stage), a_bufs.index(stage))
            tma.async_copy_global_to_shared(w_desc, [chunk_start + pid_n * BN, kk * BK], ready.index(stage),
                                            b_bufs.index(stage))


@gluon.jit
def _mainloop(a_bufs, b_bufs, ready, empty, turn, acc, local, k_steps, ROLE: gl.constexpr):
    """acc = hidden tile @ weight tile.T over the tile's K steps, one wgmma in flight, each stage released
    once read. Mainloops take turns: a ready barrier's parity names one phase only, so a consumer waits on
    its first stage only after the other consumer has waited on all of its own."""
    mbarrier.wait(turn.index(ROLE), ((local // 2) & 1) ^ (1 - ROLE))
    base = local * k_steps
    previous = base % STAGES
    for kk in range(k_steps):
        pos = base + kk
        stage = pos % STAGES
        mbarrier.wait(ready.index(stage), (pos // STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(stage), b_bufs.index(stage).permute((1, 0)), acc, use_acc=kk > 0,
                            is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index(previous), count=1, pred=kk > 0)
        previous = stage
    mbarrier.arrive(turn.index(1 - ROLE), count=1)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(empty.index(previous), count=1)
    return acc


@gluon.constexpr_function
def _mma_layout(BN):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])


@gluon.jit
def _grad_consumer(h_desc, w_desc, dz_desc, a_bufs, b_bufs, ready, empty, turn, c_smem,
                   label_col_ptr, inv_temp_ptr, max_ptr, log_sum_ptr, shifted_mean_ptr, grad_lp_ptr, grad_ent_ptr,
                   rows, hidden_size, chunk_start, chunk_width, ROLE: gl.constexpr):
    BM: gl.constexpr = h_desc.block_type.shape[0]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    layout: gl.constexpr = _mma_layout(BN)
    num_pid_m = gl.cdiv(rows, BM)
    num_pid_n = gl.cdiv(chunk_width, BN)
    k_steps = gl.cdiv(hidden_size, h_desc.block_type.shape[1])
    for local in range(ROLE, _tile_count(num_pid_m, num_pid_n), 2):
        pid_m, pid_n = _tile(local, num_pid_m, num_pid_n, GROUP_M)
        acc = gl.zeros((BM, BN), gl.float32, layout)
        acc = _mainloop(a_bufs, b_bufs, ready, empty, turn, acc, local, k_steps, ROLE)
        off_m = pid_m * BM
        off_n = chunk_start + pid_n * BN
        row_ids = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        ok = row_ids < rows
        label_col = gl.load(label_col_ptr + row_ids, mask=ok, other=-1)
        inv_temp = gl.load(inv_temp_ptr + row_ids, mask=ok, other=1.0)
        row_max = gl.load(max_ptr + row_ids, mask=ok, other=0.0)
        log_sum2 = gl.load(log_sum_ptr + row_ids, mask=ok, other=0.0) * LOG2E
        shifted_mean = gl.load(shifted_mean_ptr + row_ids, mask=ok, other=0.0)
        g_lp = gl.load(grad_lp_ptr + row_ids, mask=ok, other=0.0) * inv_temp
        g_ent = gl.load(grad_ent_ptr + row_ids, mask=ok, other=0.0) * inv_temp
        shifted = acc * gl.expand_dims(inv_temp, 1) - gl.expand_dims(row_max, 1)
        p = gl.exp2(shifted * LOG2E - gl.expand_dims(log_sum2, 1))
        dz = p * (gl.expand_dims(g_ent, 1) * (gl.expand_dims(shifted_mean, 1) - shifted) - gl.expand_dims(g_lp, 1))
        cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        dz = gl.where(gl.expand_dims(cols, 0) == gl.expand_dims(label_col, 1), dz + gl.expand_dims(g_lp, 1), dz)
        tma.store_wait(pendings=0)  # this consumer's previous tile has left c_smem
        c_smem.store(dz.to(dz_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(dz_desc, [off_m, off_n - chunk_start], c_smem)
    tma.store_wait(pendings=0)


@gluon.jit
def grad_logits_kernel(
    h_desc, w_desc, dz_desc,  # [rows, H], [valid_columns, H], [rows, chunk] (output)
    label_col_ptr, inv_temp_ptr,  # int32 [rows], fp32 [rows]
    max_ptr, log_sum_ptr, shifted_mean_ptr,  # fp32 [rows], whole vocabulary: m, log sum e^(z-m), E[z] - m
    grad_lp_ptr, grad_ent_ptr,  # fp32 [rows]: upstream gradients
    rows, hidden_size, chunk_start, chunk_width,
):
    """d_logits of one chunk of columns, as triton_kernels.grad_logits_kernel (same formula, same bits)."""
    a_bufs = gl.allocate_shared_memory(h_desc.dtype, [STAGES] + h_desc.block_type.shape, h_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    c_bufs = gl.allocate_shared_memory(dz_desc.dtype, [2] + dz_desc.block_type.shape, dz_desc.layout)
    ready, empty, turn = _barriers()
    gl.warp_specialize([
        (_grad_consumer, (h_desc, w_desc, dz_desc, a_bufs, b_bufs, ready, empty, turn, c_bufs.index(0),
                          label_col_ptr, inv_temp_ptr, max_ptr, log_sum_ptr, shifted_mean_ptr, grad_lp_ptr,
                          grad_ent_ptr, rows, hidden_size, chunk_start, chunk_width, 0)),
        (_grad_consumer, (h_desc, w_desc, dz_desc, a_bufs, b_bufs, ready, empty, turn, c_bufs.index(1),
                          label_col_ptr, inv_temp_ptr, max_ptr, log_sum_ptr, shifted_mean_ptr, grad_lp_ptr,
                          grad_ent_ptr, rows, hidden_size, chunk_start, chunk_width, 1)),
        (_load_partition, (h_desc, w_desc, a_bufs, b_bufs, ready, empty, rows, hidden_size, chunk_start,
                           chunk_width)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


@gluon.jit
def _barriers():
    """Per stage: `ready` (its loads landed) and `empty` (its wgmma read it); `turn`: each consumer's go."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(turn.index(i), count=1)
    return ready, empty, turn


def _descriptor(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))


def _programs(tiles: int, device: torch.device) -> int:
    return max(1, min(tiles, torch.cuda.get_device_properties(device).multi_processor_count))


def weight_descriptor(weight: torch.Tensor) -> TensorDescriptor:
    """The [valid_columns, H] weight as grad_logits reads it: made once per backward, reused by every chunk."""
    return _descriptor(weight, [BLOCK_N, BLOCK_K])


def grad_logits(hidden: torch.Tensor, w_desc: TensorDescriptor, dz: torch.Tensor, row_args, chunk_start: int) -> None:
    """dz [rows, chunk] (bf16) <- d_logits of the weight rows [chunk_start, chunk_start + chunk)."""
    rows, hidden_size = hidden.shape
    width = dz.shape[1]
    grid = (_programs(triton.cdiv(rows, BLOCK_M) * triton.cdiv(width, BLOCK_N), hidden.device),)
    grad_logits_kernel[grid](
        _descriptor(hidden, [BLOCK_M, BLOCK_K]), w_desc, _descriptor(dz, [BLOCK_M, BLOCK_N]), *row_args,
        rows, hidden_size, chunk_start, width, num_warps=4, maxnreg=MAX_REGS,
    )
