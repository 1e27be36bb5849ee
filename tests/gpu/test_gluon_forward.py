"""The warp-specialized Gluon forward (Hopper only) against Triton's forward kernel it replaces for plain
statistics: the same formula, operation for operation, in the same threads and registers, so the same bits for every
tile's partials. Shapes cover partial tiles in every dimension (rows not a multiple of 64 or of the consumers' 128,
whose second half may hold no row at all; H not a multiple of the K step, and one or two K steps, fewer than the
second consumer's stagger; a vocabulary with a padded last tile), labels inside and outside the shard, temperatures
other than 1, and enough tiles that each program walks many of them (the ring's stages reused across tiles)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0), reason="needs a Hopper GPU"
    ),
]


def _gluon():
    from verl_fused_hook.ops.backends.gluon_choice import gluon_forward_kernel

    module = gluon_forward_kernel(torch.device("cuda"))
    if module is None:
        pytest.skip("this Triton has no Gluon Hopper API (gluon_choice logs why)")
    return module


def _triton_partials(hidden, weight, label_col, inv_temp, col_tiles, entropy):
    from verl_fused_hook.ops.backends import triton_kernels
    from verl_fused_hook.ops.backends.triton_backend import FORWARD_CONFIG as c
    from verl_fused_hook.ops.backends.triton_backend import descriptor

    rows, hidden_size = hidden.shape
    parts = torch.full((4, col_tiles, rows), float("nan"), device="cuda")
    per = 7  # any layout gives the same per-tile bits
    splits = -(-col_tiles // per)
    triton_kernels.forward_statistics_kernel[(-(-rows // c.block_m) * splits,)](
        descriptor(hidden, [c.block_m, c.block_k]), descriptor(weight, [c.block_n, c.block_k]), label_col, inv_temp,
        parts, None, None, None, rows, hidden_size, weight.shape[0], col_tiles, per, splits,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, ENTROPY=entropy, STORE=False,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return parts


@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no entropy"])
@pytest.mark.parametrize(
    "rows, hidden_size, vocab",
    [
        (777, 520, 1500),
        (64, 4096, 9000),
        (300, 4104, 9000),
        (4096, 2048, 16384),
        (1031, 3584, 152064),
        (200, 64, 3000),
        (130, 128, 3000),
    ],  # fmt: skip
)
def test_tile_partials_match_the_triton_kernel_bit_for_bit(rows, hidden_size, vocab, entropy):
    gluon = _gluon()
    g = torch.Generator(device="cuda").manual_seed(rows + vocab)
    hidden = torch.randn(rows, hidden_size, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=g) * 3 * hidden_size**-0.5).bfloat16()
    label_col = torch.randint(-1, vocab, (rows,), device="cuda", generator=g, dtype=torch.int32)
    inv_temp = 1 / (torch.rand(rows, device="cuda", generator=g) + 0.5)
    col_tiles = -(-vocab // gluon.BLOCK_N)
    ours = torch.full((4, col_tiles, rows), float("nan"), device="cuda")
    gluon.tile_partials(hidden, gluon.weight_descriptor(weight), vocab, label_col, inv_temp, ours, entropy, 132)
    theirs = _triton_partials(hidden, weight, label_col, inv_temp, col_tiles, entropy)
    assert not ours.isnan().any()
    assert torch.equal(ours, theirs), (ours != theirs).sum().item()


def test_few_programs_walk_every_tile():
    """Two programs for 8 x 36 tiles of 128 rows: each walks over a hundred; the result must not change."""
    gluon = _gluon()
    g = torch.Generator(device="cuda").manual_seed(5)
    rows, hidden_size, vocab = 1000, 1024, 9000
    hidden = torch.randn(rows, hidden_size, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=g) * hidden_size**-0.5).bfloat16()
    label_col = torch.randint(0, vocab, (rows,), device="cuda", generator=g, dtype=torch.int32)
    inv_temp = torch.full((rows,), 1 / 0.7, device="cuda")
    col_tiles = -(-vocab // gluon.BLOCK_N)
    w_desc = gluon.weight_descriptor(weight)
    outs = []
    for programs in (2, 3, 132):
        out = torch.full((4, col_tiles, rows), float("nan"), device="cuda")
        gluon.tile_partials(hidden, w_desc, vocab, label_col, inv_temp, out, True, programs)
        outs.append(out)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_the_plain_forward_uses_it_on_hopper():
    import triton

    from verl_fused_hook.ops.backends import gluon_forward
    from verl_fused_hook.ops.backends.gluon_choice import MIN_TRITON, gluon_forward_kernel

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < MIN_TRITON:
        pytest.skip(f"Triton {triton.__version__}")
    assert gluon_forward_kernel(torch.device("cuda")) is gluon_forward
