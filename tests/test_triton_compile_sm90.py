"""Every Triton kernel compiles for Hopper (sm_90) in the configurations the launches use, within its shared memory.

Why on the CPU: the interpreter checks a kernel's arithmetic, not what the GPU will accept. A tile or a kept-logits
store that needs more than the 227 KiB of shared memory an H100 or H200 gives a block compiles in the interpreter and
fails at its first launch on the GPU, where device time is scarce. Triton compiles ahead of time for a named target
with the ptxas it ships, no GPU needed; the signatures below mirror the launches in triton_backend.py and
triton_selected_tokens.py (tile shapes from their FORWARD_CONFIG and GRAD_CONFIG).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from verl_fused_hook.ops.backends import triton_kernels as kernels  # noqa: E402
from verl_fused_hook.ops.backends.triton_backend import FORWARD_CONFIG, GRAD_BLOCK, GRAD_CONFIG  # noqa: E402
from verl_fused_hook.ops.backends.triton_selected_tokens import (  # noqa: E402
    GROUP_COLUMNS,
    HIDDEN_BLOCK,
    SPARSE_ADD_BLOCK,
    TOKEN_BLOCK,
)

HOPPER = GPUTarget("cuda", 90, 32)
SHARED_LIMIT = 232448  # bytes of shared memory a block may opt into on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin)
# Triton before 3.7 (torch 2.11's 3.6, the device's) spills a little more in two kernels than 3.8 (CI's): their bounds.
OLD_TRITON = tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7)


def _compile(kernel, signature: dict, constants: dict, num_warps: int, num_stages: int = 3):
    source = ASTSource(fn=kernel, signature=signature | dict.fromkeys(constants, "constexpr"), constexprs=constants)
    return triton.compile(source, target=HOPPER, options={"num_warps": num_warps, "num_stages": num_stages})


def _forward_signature(store: bool, raw: bool) -> dict:
    c = FORWARD_CONFIG
    kept = f"tensordesc<fp32[{c.block_m}, {c.block_n // 2}]>" if raw else f"tensordesc<fp16[{c.block_m}, {c.block_n}]>"
    group_max = f"tensordesc<fp32[{c.block_m}, {c.block_n // GROUP_COLUMNS}]>"
    return {
        "h_desc": f"tensordesc<bf16[{c.block_m}, {c.block_k}]>",
        "w_desc": f"tensordesc<bf16[{c.block_n}, {c.block_k}]>",
        "label_col_ptr": "*i32",
        "inv_temp_ptr": "*fp32",
        "parts_ptr": "*fp32",
        "store_desc": kept if store else "constexpr",
        "tile_max_ptr": "*fp32" if store else "constexpr",
        "group_max_desc": group_max if raw else "constexpr",
        "rows": "i32",
        "H": "i32",
        "valid_columns": "i32",
        "num_col_tiles": "i32",
        "tiles_per_split": "i32",
        "num_splits": "i32",
    }


@pytest.mark.parametrize(
    "store,raw",
    [(False, False), (True, False), (True, True)],
    ids=["statistics", "keeping fp16 logits (fused loss)", "keeping fp32 logits (top-k)"],
)
@pytest.mark.parametrize("squares", [False, True], ids=["no squares", "sum pi^2"])
def test_forward_statistics_kernel_fits_hopper(store, raw, squares):
    c = FORWARD_CONFIG
    constants = dict(
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, ENTROPY=True, STORE=store,
        SQUARES=squares, RAW=raw, GROUP_N=GROUP_COLUMNS,
    )  # fmt: skip
    if not store:
        constants |= {"store_desc": None, "tile_max_ptr": None}
    if not raw:
        constants |= {"group_max_desc": None}
    signature = _forward_signature(store, raw)
    compiled = _compile(kernels.forward_statistics_kernel, signature, constants, c.num_warps, c.num_stages)
    assert 0 < compiled.metadata.shared <= SHARED_LIMIT, compiled.metadata.shared
    # Registers: the 128 x 256 fp32 accumulator takes half of the 255. The per-tile partials' four stores, written
    # apart, spilled 148 bytes a thread through the K loop; as one joined store none (the fp16-keeping variant
    # spilled 180 bytes before per-tile partials, 152 now; no launch keeps fp16 logits with square sums).
    if not (store and not raw and squares):
        assert _spilled_bytes(compiled) <= (152 if store and not raw else 0)


def _spilled_bytes(compiled) -> int:
    """Spill stores per thread of a compiled kernel, as the ptxas Triton ships reports them (`ptxas -v`)."""
    import os
    import re
    import subprocess
    import tempfile

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as handle:
            handle.write(compiled.asm["ptx"])
        done = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", source, "-o", os.path.join(folder, "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    return int(re.search(r"(\d+) bytes spill stores", done.stderr).group(1))


def test_grad_logits_kernel_fits_hopper():
    c = GRAD_CONFIG
    signature = {
        "h_desc": f"tensordesc<bf16[{c.block_m}, {c.block_k}]>",
        "w_desc": f"tensordesc<bf16[{c.block_n}, {c.block_k}]>",
        "dz_desc": f"tensordesc<bf16[{c.block_m}, {c.block_n}]>",
        **dict.fromkeys(["label_col_ptr"], "*i32"),
        **dict.fromkeys(
            ["inv_temp_ptr", "max_ptr", "log_sum_ptr", "shifted_mean_ptr", "grad_lp_ptr", "grad_ent_ptr"], "*fp32"
        ),
        **dict.fromkeys(["rows", "H", "chunk_start", "chunk_width", "num_programs"], "i32"),
    }
    constants = dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m)
    compiled = _compile(kernels.grad_logits_kernel, signature, constants, c.num_warps, c.num_stages)
    assert 0 < compiled.metadata.shared <= SHARED_LIMIT, compiled.metadata.shared


def test_the_elementwise_kernels_compile_for_hopper():
    """The kept logits' gradient pass and token_log_probs' gather-dot, sparse sort and add (no TMA, small shared
    use)."""
    fp32 = "*fp32"
    stored = {
        "shifted_ptr": "*fp16",
        "dz_ptr": "*bf16",
        "stride_row": "i32",
        "tile_max_ptr": fp32,
        "tile_max_stride": "i32",
        "label_col_ptr": "*i64",
        **dict.fromkeys(
            ["inv_temp_ptr", "max_ptr", "log_sum_ptr", "shifted_mean_ptr", "grad_lp_ptr", "grad_ent_ptr"], fp32
        ),
        "columns": "i32",
    }
    gather = {
        "h_ptr": "*bf16", "h_stride": "i32", "w_ptr": "*bf16", "w_stride": "i32", "columns_ptr": "*i64",
        "inv_temp_ptr": fp32, "out_ptr": fp32, "entries": "i32", "H": "i32",
    }  # fmt: skip
    sort_sparse = {
        "columns_ptr": "*i64", "coefficients_ptr": fp32, "entries": "i32", "out_columns_ptr": "*i32",
        "out_coefficients_ptr": fp32, "bounds_ptr": "*i32", "chunk_width": "i32", "chunks": "i32",
    }  # fmt: skip
    sparse = {
        "dz_ptr": "*bf16", "dz_stride": "i32", "columns_ptr": "*i32", "coefficients_ptr": fp32, "bounds_ptr": "*i32",
        "bounds_stride": "i32", "inv_temp_ptr": fp32, "entries": "i32", "chunk": "i32", "chunk_start": "i32",
    }  # fmt: skip
    launches = [
        (kernels.stored_grad_logits_kernel, stored, dict(TILE_N=FORWARD_CONFIG.block_n, BLOCK=GRAD_BLOCK), 8),
        (kernels.token_logits_kernel, gather, dict(BLOCK_T=TOKEN_BLOCK, BLOCK_H=HIDDEN_BLOCK), 4),
        (kernels.add_sparse_gradient_kernel, sparse, dict(BLOCK=SPARSE_ADD_BLOCK), 1),
    ]
    for kernel, signature, constants, warps in launches:
        compiled = _compile(kernel, signature, constants, warps)
        assert compiled.metadata.shared <= SHARED_LIMIT, (kernel.fn.__name__, compiled.metadata.shared)
    for block in (256, 2048):  # the sort's row in registers: k = 128 ids, and 1024 with the label (no spills)
        compiled = _compile(kernels.sort_sparse_gradient_kernel, sort_sparse, dict(BLOCK=block), 4)
        assert compiled.metadata.shared <= SHARED_LIMIT and _spilled_bytes(compiled) == 0, block


@pytest.mark.parametrize("planes", [4, 5], ids=["statistics", "with square sums"])
def test_the_tile_merge_adds_a_rows_tiles_inside_one_thread_whatever_the_row_count(planes):
    """merge_tiles_kernel's bits for a row must not depend on how many rows a call has. Triton compiles a variant
    for an integer argument divisible by 16, and on an H100 the variant for 1024 rows of the earlier split merge
    spread the splits over four warps (a cross-warp sum: other bits than 777 rows gave;
    tests/gpu/test_batch_invariance_cuda.py caught it). So the counts are never specialized, and the one variant
    left keeps each row's tiles in one thread (threads and warps only along the rows), where their sum has one
    order."""
    import re

    from verl_fused_hook.ops.backends.triton_backend import MERGE_ROWS, MERGE_TILES

    specialized = {p.name for p in kernels.merge_tiles_kernel.params if p.do_not_specialize}
    assert specialized == {"rows", "num_tiles", "tiles_per_program", "out_stride", "out_group_stride"}
    counts = dict.fromkeys(["rows", "num_tiles", "tiles_per_program", "out_stride", "out_group_stride"], "i32")
    signature = {"parts_ptr": "*fp32", "out_ptr": "*fp32"} | counts
    constants = dict(PLANES=planes, BLOCK_S=MERGE_TILES, BLOCK_R=MERGE_ROWS)
    compiled = _compile(kernels.merge_tiles_kernel, signature, constants, 1)  # as triton_backend.merge_tiles launches
    tiles = re.findall(r"#ttg\.blocked<\{sizePerThread = \[(\d+), (\d+)\], threadsPerWarp = \[(\d+), (\d+)\], "
                       r"warpsPerCTA = \[(\d+), (\d+)\]", compiled.asm["ttgir"])  # fmt: skip
    assert tiles, compiled.asm["ttgir"][:2000]
    for _, _, threads_along_tiles, _, warps_along_tiles, _ in tiles:
        assert (threads_along_tiles, warps_along_tiles) == ("1", "1"), tiles


@pytest.mark.parametrize("top_k", [32, 128, 512, 1024], ids=["k=32", "k=128", "k=512", "the kernel's largest k"])
def test_the_top_k_kernel_keeps_a_row_in_registers_for_hopper(top_k):
    """top_k_kernel holds a row's tile maxima (1024 tiles: V = 262144 at TP 1), then its picked tiles' group maxima
    and its picked groups' logits in registers at the launch's warps, reading asked columns too: compiled for sm_90
    without spills up to k = 512 (distillation's 32-128 among them); at the kernel's largest k (sampling replay's
    wider pass, 513 by default) 16 warps spill 120 bytes a thread with Triton 3.8 (32 warps 208), 124 with 3.6
    (torch 2.11's)."""
    from verl_fused_hook.ops.backends.triton_selected_tokens import (
        MAX_SELECTION_TILES,
        MAX_SELECTION_TOP_K,
        TOP_K_TOKENS_BLOCK,
        _selection_blocks,
        top_k_warps,
    )

    fp32, i32 = "*fp32", "i32"
    signature = {
        "raw_ptr": fp32, "raw_stride": i32, "token_columns_ptr": "*i64", "token_logits_ptr": fp32, "tokens": i32,
        "tile_max_ptr": fp32, "tile_stride": i32, "group_max_ptr": fp32,
        "group_stride": i32, "inv_temp_ptr": fp32,
        "scratch_ptr": "*i32", "values_ptr": fp32, "ids_ptr": "*i64", "out_stride": i32, "tiles": i32,
        "valid_columns": i32, "wanted": i32, "vocab_start": i32,
    }  # fmt: skip
    assert top_k <= MAX_SELECTION_TOP_K == 1024
    width = FORWARD_CONFIG.block_n
    columns = MAX_SELECTION_TILES * width
    assert _selection_blocks(columns, width, MAX_SELECTION_TOP_K) == (MAX_SELECTION_TILES, MAX_SELECTION_TOP_K)
    assert _selection_blocks(columns + 1, width, top_k) is None
    assert _selection_blocks(columns, width, MAX_SELECTION_TOP_K + 1) is None
    per_tile = width // GROUP_COLUMNS
    constants = dict(
        GROUP=GROUP_COLUMNS, PER_TILE=per_tile, BLOCK_T=MAX_SELECTION_TILES, BLOCK_K=top_k,
        TOKENS_BLOCK=TOP_K_TOKENS_BLOCK,
    )  # fmt: skip
    warps = top_k_warps(MAX_SELECTION_TILES, top_k, GROUP_COLUMNS, per_tile)
    compiled = _compile(kernels.top_k_kernel, signature, constants, num_warps=warps, num_stages=1)
    assert compiled.metadata.shared <= SHARED_LIMIT
    assert _spilled_bytes(compiled) <= (0 if top_k <= 512 else 124 if OLD_TRITON else 120)


@pytest.mark.parametrize(
    "entropy, squares, raw",
    [(True, False, False), (False, False, False), (True, True, False), (True, True, True), (False, False, True)],
    ids=["entropy", "no entropy", "sum pi^2", "sum pi^2, keeping fp32 logits (top-k)", "keeping fp32 logits"],
)
def test_gluon_forward_kernel_fits_hopper(entropy, squares, raw):
    """The warp-specialized forward: its four-stage ring (two hidden tiles and one weight tile a stage, 192 KiB) and,
    keeping fp32 logits, the consumers' staging buffers (24 KiB) within shared memory, the consumers' 232 registers
    without spills (a spill there would sit in the epilogue)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from verl_fused_hook.ops.backends import gluon_forward as g

    def desc(block, dtype=gl.bfloat16, name="bf16"):
        layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
        return f"tensordesc<{name}[{block[0]}, {block[1]}],{layout!r}>"

    signature = {
        "h_desc": desc([g.BLOCK_M, g.BLOCK_K]),
        "w_desc": desc([g.BLOCK_N, g.BLOCK_K]),
        "label_col_ptr": "*i32",
        **dict.fromkeys(["inv_temp_ptr", "parts_ptr"], "*fp32"),
        "raw_desc": desc([g.BLOCK_M, g.RAW_COLUMNS], gl.float32, "fp32") if raw else "constexpr",
        "tile_max_ptr": "*fp32" if raw else "constexpr",
        "group_max_desc": desc([g.BLOCK_M, g.BLOCK_N // g.GROUP_COLUMNS], gl.float32, "fp32") if raw else "constexpr",
        **dict.fromkeys(["rows", "hidden_size", "valid_columns", "num_col_tiles"], "i32"),
        **dict.fromkeys(["ENTROPY", "SQUARES", "RAW"], "constexpr"),
    }
    constants = {"ENTROPY": entropy, "SQUARES": squares, "RAW": raw}
    if not raw:
        constants |= dict.fromkeys(["raw_desc", "tile_max_ptr", "group_max_desc"])
    source = GluonASTSource(fn=g.tile_partials_kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=HOPPER, options={"num_warps": 4, "maxnreg": g.MAX_REGS})
    assert 0 < compiled.metadata.shared <= SHARED_LIMIT, compiled.metadata.shared
    # Triton 3.6 (torch 2.11's) spills ~412 bytes keeping fp32 logits: loop invariants (the staging stores' shared
    # addresses), stored once before the tile loop and reloaded after each tile's K loop (its SASS: every STL in the
    # prologue), not the accumulator. 3.8 spills nothing.
    assert _spilled_bytes(compiled) <= (416 if raw and OLD_TRITON else 0)


def test_gluon_forward_tiles_are_the_triton_kernels_columns():
    """forward_partials sizes the partials' planes by FORWARD_CONFIG's tile width for either kernel, and KeptLogits
    its group maxima by GROUP_COLUMNS: a Gluon tile or group of another width would write into the wrong slots."""
    from verl_fused_hook.ops.backends import gluon_forward

    assert gluon_forward.BLOCK_N == FORWARD_CONFIG.block_n == 256
    assert gluon_forward.GROUP_COLUMNS == GROUP_COLUMNS  # the kept group maxima's width, as KeptLogits allocates it
