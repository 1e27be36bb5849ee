"""The bench's sampling-replay methods (commands/bench/replay.py) at a small shape on the CPU: the synthetic kept sets
are sets (each id once, the label in slot 0 only), every method's accuracy check runs against fp64 masked logits
(fp32 inputs: 1e-5), and the masked-logits baseline and the op agree on the same sets. No timing."""

from __future__ import annotations

import torch

from verl_fused_hook_harness.commands.bench import replay as bench_replay

N, H, V = 40, 16, 1500  # V above the mix's 512-wide sets


def _inputs():
    g = torch.Generator().manual_seed(5)
    return torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.5, torch.randint(0, V, (N,), generator=g)


def test_synthetic_sets_hold_each_id_once_and_the_label_first():
    _, _, labels = _inputs()
    for kind, width in (("20", 20), ("64", 64), ("mix", 512)):
        kept = bench_replay._sets_for(labels, V, kind)
        assert kept.shape == (N, width) and torch.equal(kept[:, 0], labels)
        for row in kept:
            ids = row[row >= 0]
            assert ids.unique().numel() == ids.numel() and bool((ids < V).all())
        sizes = (kept >= 0).sum(1)
        assert bool((sizes == width).all()) if kind != "mix" else 1 <= int(sizes.min()) < int(sizes.max()) <= 512


def test_methods_agree_with_fp64_on_the_cpu():
    hidden, weight, labels = _inputs()
    loaded = {name: load() for name, load in bench_replay.loaders().items()}
    for name, fn in loaded.items():
        accuracy = fn.accuracy(hidden, weight, labels, 0.7)
        assert accuracy["log_prob_max_err"] <= 1e-5 and accuracy["entropy_max_err"] <= 1e-5, (name, accuracy)
        assert accuracy["d_hidden_rel_err"] <= 1e-5 and accuracy["d_weight_rel_err"] <= 1e-5, (name, accuracy)
        if name == "replay_trainer":
            assert accuracy["sets_differ_rows"] == 0
    ours = loaded["replay_given_mix"](hidden, weight, labels, 0.7)
    today = loaded["replay_masked_logits"](hidden, weight, labels, 0.7)
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(ours, today))
