"""The warp-specialized Gluon forward (Hopper only) against Triton's forward kernel it replaces for plain
statistics, square sums and kept fp32 logits: the same formula, operation for operation, in the same threads and
registers, so the same bits for every tile's partials, and the same kept logits, tile and group maxima. Shapes cover
partial tiles in every dimension (rows not a multiple of 64 or of the consumers' 128, whose second half may hold no
row at all; H not a multiple of the K step, and one or two K steps, fewer than the second consumer's stagger; a
vocabulary with a padded last tile), labels inside and outside the shard, temperatures other than 1, and enough
tiles that each program walks many of them (the ring's stages reused across tiles)."""

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


def _triton_partials(hidden, weight, label_col, inv_temp, col_tiles, entropy, squares=False, kept=None):
    """Triton's forward kernel's per-tile partials (and, with `kept` = (raw, tile maxima, group maxima), the kept
    fp32 logits and maxima written there: its STORE and RAW flags)."""
    from verl_fused_hook.ops.backends import triton_kernels
    from verl_fused_hook.ops.backends.triton_backend import FORWARD_CONFIG as c
    from verl_fused_hook.ops.backends.triton_backend import descriptor

    rows, hidden_size = hidden.shape
    parts = torch.full((5 if squares else 4, col_tiles, rows), float("nan"), device="cuda")
    stored = (None, None, None)
    if kept is not None:
        raw, tile_max, group_max = kept
        stored = (descriptor(raw, [c.block_m, c.block_n // 2]), tile_max, descriptor(group_max, [c.block_m, 16]))
    per = 7  # any layout gives the same per-tile bits
    splits = -(-col_tiles // per)
    triton_kernels.forward_statistics_kernel[(-(-rows // c.block_m) * splits,)](
        descriptor(hidden, [c.block_m, c.block_k]), descriptor(weight, [c.block_n, c.block_k]), label_col, inv_temp,
        parts, *stored, rows, hidden_size, weight.shape[0], col_tiles, per, splits,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, ENTROPY=entropy,
        STORE=kept is not None, SQUARES=squares, RAW=kept is not None, GROUP_N=16,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    return parts


def _kept_buffers(rows, vocab, col_tiles):
    """NaN-filled kept fp32 logits (rows 16-byte aligned, as KeptLogits allocates them), tile and group maxima."""
    pitch = -(-vocab // 8) * 8
    return (
        torch.full((rows, pitch), float("nan"), device="cuda")[:, :vocab],
        torch.full((rows, col_tiles), float("nan"), device="cuda"),
        torch.full((rows, col_tiles * 16), float("nan"), device="cuda"),
    )


def _inputs(rows, hidden_size, vocab, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(vocab, hidden_size, device="cuda", generator=g) * 3 * hidden_size**-0.5).bfloat16()
    label_col = torch.randint(-1, vocab, (rows,), device="cuda", generator=g, dtype=torch.int32)
    inv_temp = 1 / (torch.rand(rows, device="cuda", generator=g) + 0.5)
    return hidden, weight, label_col, inv_temp


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
    hidden, weight, label_col, inv_temp = _inputs(rows, hidden_size, vocab, rows + vocab)
    col_tiles = -(-vocab // gluon.BLOCK_N)
    ours = torch.full((4, col_tiles, rows), float("nan"), device="cuda")
    gluon.tile_partials(hidden, gluon.weight_descriptor(weight), vocab, label_col, inv_temp, ours, entropy, 132)
    theirs = _triton_partials(hidden, weight, label_col, inv_temp, col_tiles, entropy)
    assert not ours.isnan().any()
    assert torch.equal(ours, theirs), (ours != theirs).sum().item()


@pytest.mark.parametrize("squares", [True, False], ids=["sum pi^2", "no squares"])
@pytest.mark.parametrize(
    "rows, hidden_size, vocab",
    [(777, 520, 1500), (1536, 4096, 151936), (300, 64, 3000), (129, 4104, 9000), (1000, 1024, 100)],
)
def test_kept_logits_and_square_sums_match_the_triton_kernel_bit_for_bit(rows, hidden_size, vocab, squares):
    """token_log_probs' top-k forward: the kept fp32 logits (every valid column written, nothing past the row's
    last), each tile's and each 16-column group's max (groups of padding only: the padding logit), and the square
    sums, the same bits as Triton's RAW kernel writes. Vocabularies: a padded last tile, the top-k's chunk of 1536
    rows at 151936, and fewer columns than one tile."""
    gluon = _gluon()
    hidden, weight, label_col, inv_temp = _inputs(rows, hidden_size, vocab, rows * vocab)
    col_tiles = -(-vocab // gluon.BLOCK_N)
    planes = 5 if squares else 4
    ours = torch.full((planes, col_tiles, rows), float("nan"), device="cuda")
    ours_kept = _kept_buffers(rows, vocab, col_tiles)
    gluon.tile_partials(hidden, gluon.weight_descriptor(weight), vocab, label_col, inv_temp, ours, True, 132, ours_kept)
    theirs_kept = _kept_buffers(rows, vocab, col_tiles)
    theirs = _triton_partials(hidden, weight, label_col, inv_temp, col_tiles, True, squares, theirs_kept)
    assert not ours.isnan().any() and torch.equal(ours, theirs), (ours != theirs).sum().item()
    for name, mine, other in zip(("logits", "tile maxima", "group maxima"), ours_kept, theirs_kept):
        assert not mine.isnan().any(), name
        assert torch.equal(mine, other), (name, (mine != other).sum().item())
    pitch_tail = ours_kept[0].as_strided((rows, -(-vocab // 8) * 8 - vocab), (ours_kept[0].stride(0), 1), vocab)
    assert pitch_tail.isnan().all(), "a store past the row's last column"
    exact = (hidden.float() @ weight.float().T)[:, :vocab]
    torch.testing.assert_close(ours_kept[0], exact, rtol=1e-4, atol=1e-4)  # fp32 accumulation of bf16 products


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
