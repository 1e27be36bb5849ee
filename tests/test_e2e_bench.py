"""`e2e-bench` options on the CPU (timings there mean nothing): `--layers` and `--recompute` reach the built model
(its config's fields, as the report records them) and a run with both completes, hook mode still identical to
legacy on the portable op. Its table reports each mode once per size, with the numbers of the rounds that timed it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from table_titles import assert_every_table_names

from verl_fused_hook_harness.support.distributed import run_in_processes
from verl_fused_hook_harness.support.reports import gib, ms

ROOT = Path(__file__).resolve().parent.parent


def _cells(line: str) -> list[str]:
    """A markdown table line's cells."""
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _bench_worker(rank, world_size, out, *extra):
    from verl_fused_hook_harness.commands.e2e import bench as e2e_bench

    return e2e_bench.main(
        [
            "--device",
            "cpu",
            "--hf-config",
            str(ROOT / "verl_fused_hook_harness/configs/tiny_qwen2"),
            "--modes",
            "legacy,hook+ours",
            "--sizes",
            "128",
            "--warmups",
            "1",
            "--repeats",
            "1",
            "--out",
            str(out),
            *extra,
        ]
    )


def test_layers_and_recompute_reach_the_model_and_the_run_completes(tmp_path):
    assert run_in_processes(_bench_worker, 1, tmp_path, "--layers", "3", "--recompute")[0] == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert report["model"] == {  # the tiny config has 2 layers and no recompute
        "num_layers": 3,
        "recompute_granularity": "full",
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
    }
    (size,) = report["sizes"]
    rows = {row["mode"]: row for row in size["modes"]}
    assert all(row["train_s"] > 0 and row["train_peak_bytes"] > 0 for row in rows.values())
    parity = rows["hook+ours"]["vs_legacy"]
    assert parity["log_probs"] == parity["entropy"] == parity["policy_loss"] == parity["grads_max_abs"] == 0.0


def test_without_the_options_the_config_decides_and_profiles_and_spreads_are_written(tmp_path):
    assert (
        run_in_processes(_bench_worker, 1, tmp_path, "--repeats", "2", "--profile", str(tmp_path / "profile"))[0] == 0
    )
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert report["model"] == {
        "num_layers": 2,
        "recompute_granularity": None,
        "recompute_method": None,
        "recompute_num_layers": None,
    }
    for row in report["sizes"][0]["modes"]:  # every repeat kept: the noise is stated, not only the median
        assert len(row["train_times_s"]) == len(row["forward_times_s"]) == 2
        text = (tmp_path / "profile" / f"profile_128_{row['mode']}.txt").read_text()
        assert f"# {row['mode']}: by device time" in text and f"# {row['mode']}: by host time" in text
        assert "aten::mm" in text  # the profiler's operator table, not an empty file
        no_grad = (tmp_path / "profile" / f"profile_128_{row['mode']}_no_grad.txt").read_text()
        assert f"# {row['mode']}: by device time" in no_grad and "aten::mm" in no_grad
        assert "backward" not in no_grad.lower()  # the forward alone
    assert " ±" in (tmp_path / "e2e.md").read_text()
    assert_every_table_names((tmp_path / "e2e.md").read_text(), "cpu", 1)
    rows = report["sizes"][0]["modes"]  # the table: a line per mode, the JSON's numbers
    lines = [_cells(line) for line in (tmp_path / "e2e.md").read_text().splitlines() if line.startswith("| 128 ")]
    assert [line[1] for line in lines] == [row["mode"] for row in rows] == ["legacy", "hook+ours"]
    assert [line[3].split(" ±")[0] for line in lines] == [ms(row["train_s"]) for row in rows]


def test_a_size_given_twice_is_refused(capsys):
    """A size given twice was measured twice and reported as a second set of rows (and, on CUDA, a second legacy
    rerun) at that size: refused before anything is built."""
    from verl_fused_hook_harness.commands.e2e import bench as e2e_bench

    with pytest.raises(SystemExit):
        e2e_bench.main(["--device", "cpu", "--sizes", "256,128,256"])
    assert "--sizes: [256] given more than once; each size is measured and reported once" in capsys.readouterr().err


def test_the_table_reports_each_mode_once_per_size_with_its_rounds_numbers():
    """Rows as a run fills them: one per mode at each size when its parity step is done, then the timed rounds
    (repeats over every mode) writing into those rows. The table has each (size, mode) once and one legacy rerun per
    size, each time cell the median of that mode's own repeats."""
    import torch

    from verl_fused_hook_harness.commands.e2e.common import Clock, Primed, time_in_rounds
    from verl_fused_hook_harness.commands.e2e.thd import MODES, PARITY_KEY, markdown_table

    parity = {
        "log_probs": 1.91e-06,
        "entropy": 2.86e-06,
        "policy_loss": 0.0,
        "grads_max_abs": 0.000427,
        "grads_rel": 0.012,
    }
    report, sizes = {"layout": "thd", "device": "cpu", "sizes": []}, (128, 256)
    for tokens in sizes:
        entry = {
            "tokens": tokens,
            "sequence_lengths": [tokens // 8] * 8,
            "modes": [],
            "legacy_rerun": dict.fromkeys(parity, 0.0),
        }
        report["sizes"].append(entry)
        primed = []
        for index, mode in enumerate(MODES):
            row = {"mode": mode.name, "kernel": mode.kernel, "masked": mode.score_mask}
            if mode.name != "legacy":
                row[PARITY_KEY["thd"]] = parity
            entry["modes"].append(row)
            work = lambda elements=1000 * (index + 1): torch.empty(elements)  # noqa: E731  (a peak per mode)
            primed.append(Primed(None, row, lambda: None, {"train": work, "forward": work}))
        time_in_rounds(primed, Clock("cpu"), 3, {"train": None, "forward": None}, on_oom=None)

    table = markdown_table(report)
    title = "Training step and no-grad forward per mode (thd) on cpu, parity against the reference:"
    assert table.splitlines()[0] == title
    lines = [_cells(line) for line in table.splitlines()[4:]]
    labels = {tokens: f"{tokens:,} (8)" for tokens in sizes}
    assert [(line[0], line[1]) for line in lines] == [
        (labels[tokens], name) for tokens in sizes for name in [m.name for m in MODES] + ["legacy rerun"]
    ]
    rows = {(labels[size["tokens"]], row["mode"]): row for size in report["sizes"] for row in size["modes"]}
    for line in lines:
        if line[1] == "legacy rerun":
            assert line[7:] == ["0", "0", "0", "0 (0)"]
            continue
        row = rows[(line[0], line[1])]
        assert len(row["train_times_s"]) == len(row["forward_times_s"]) == 3
        assert line[3].split(" ±")[0] == ms(row["train_s"]) and row["train_s"] == sorted(row["train_times_s"])[1]
        assert line[4] == gib(row["train_peak_bytes"]) and row["train_peak_bytes"] >= 4000
        assert line[7] == ("reference" if line[1] == "legacy" else "1.91e-06")


def test_layers_must_be_positive(capsys):
    from verl_fused_hook_harness.commands.e2e import bench as e2e_bench

    with pytest.raises(SystemExit):
        e2e_bench.main(["--device", "cpu", "--layers", "0"])
    assert "--layers: expected >= 1, got 0" in capsys.readouterr().err


def test_timed_repeats_run_in_rounds_over_the_modes():
    """A drift in the machine's speed must not favour the mode timed first: repeats go A, B, A, B, ...; each mode's
    own timed steps feed its tally."""
    import torch

    from verl_fused_hook_harness.commands.e2e.common import Clock, Primed, time_in_rounds

    calls, modes_set, counter = [], [], [0]

    def work(name, kind):
        def run():
            calls.append((name, kind, torch.is_grad_enabled()))
            counter[0] += name == "b"  # only mode b's steps count (as the fused loss's calls)

        return run

    def no_grad(run):
        def wrapped():
            with torch.no_grad():
                run()

        return wrapped

    primed = [
        Primed(
            f"step {name}",
            {"mode": name},
            lambda name=name: modes_set.append(name),
            {"train": work(name, "train"), "forward": no_grad(work(name, "forward"))},
        )
        for name in ("a", "b")
    ]
    prepared = []
    time_in_rounds(
        primed,
        Clock("cpu"),
        3,
        {"train": lambda: prepared.append(1), "forward": None},
        None,
        ("calls", lambda: counter[0]),
    )
    assert (
        calls
        == [("a", "train", True), ("b", "train", True)] * 3 + [("a", "forward", False), ("b", "forward", False)] * 3
    )
    assert modes_set == ["a", "b"] * 6  # each timed step runs in its own mode
    assert len(prepared) == 6  # before each timed training step only
    assert [p.row["calls"] for p in primed] == [0, 6]
    for p in primed:
        assert len(p.row["train_times_s"]) == len(p.row["forward_times_s"]) == 3
        assert p.row["train_s"] >= 0 and p.row["forward_peak_bytes"] >= 0


def test_replay_modes_run_beside_the_others_and_raise_every_log_prob(tmp_path):
    """`--replay 50,0.9` adds the replay modes (kept sets computed, and given as synthetic `rollout_kept_ids`) to the
    same rounds. Renormalizing over a set that holds the label cannot lower its probability: every replayed log-prob
    on the rows the loss reads lies above legacy's full-vocabulary one (the tiny random model spreads its mass, so by
    far more than fp32 noise), and the kept mass is a probability below 1."""
    modes = "legacy,hook+ours+mask,hook+ours+mask+replay,hook+ours+mask+replay-given"
    assert run_in_processes(_bench_worker, 1, tmp_path, "--replay", "50,0.9", "--modes", modes)[0] == 0
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert report["replay"] == {"top_k": 50, "top_p": 0.9}
    rows = {row["mode"]: row for row in report["sizes"][0]["modes"]}
    assert list(rows) == modes.split(",")
    assert rows["hook+ours+mask"]["vs_legacy"]["log_probs"] == 0.0  # the same portable op on the CPU
    for name in ("hook+ours+mask+replay", "hook+ours+mask+replay-given"):
        row = rows[name]
        assert "vs_legacy" not in row  # no parity: the values are renormalized by design
        assert row["replay_vs_full"]["min_log_prob_rise"] > 0.1, row
        assert 0.0 < row["replay_vs_full"]["mean_kept_mass"] < 0.5, row
        assert row["train_s"] > 0 and row["forward_s"] > 0 and len(row["train_times_s"]) == 1
    table = (tmp_path / "e2e.md").read_text()
    replay_line = next(_cells(line) for line in table.splitlines() if "| hook+ours+mask+replay |" in line)
    assert replay_line[8:] == ["n/a (replay)"] * 3
    assert "Replay rows (rollout top_k=50, top_p=0.9): no parity with legacy" in table


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replay=-1,0.9"], "--replay: expected 1 <= TOP_K <= 512"),
        (["--replay", "50,1.5"], "--replay: expected 1 <= TOP_K <= 512"),
        (["--replay", "50"], "--replay: expected TOP_K,TOP_P (e.g. 50,0.9), got '50'"),
        (["--replay", "50,0.9", "--layout", "bshd"], "--replay runs on the packed layout's modes"),
        (["--modes", "legacy,hook+ours+mask+replay"], "['hook+ours+mask+replay'] need --replay TOP_K,TOP_P"),
    ],
)
def test_replay_arguments_are_checked_before_anything_is_built(argv, message, capsys):
    from verl_fused_hook_harness.commands.e2e import bench as e2e_bench

    with pytest.raises(SystemExit):
        e2e_bench.main(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def test_synthetic_kept_sets_hold_their_label_first_and_distinct_ids():
    """Each response token's set: the token itself first, 1 to width ids in all, each id once; -1 past a response."""
    import torch

    from verl_fused_hook_harness.support.micro_batches import jagged, synthetic_kept_sets

    generator = torch.Generator().manual_seed(3)
    responses = [torch.randint(0, 1000, (n,), generator=generator) for n in (7, 3, 12)]
    kept = synthetic_kept_sets(jagged(responses), 50, 1000, seed=0)
    assert kept.shape == (3, 12, 50) and kept.dtype == torch.int64
    sizes = []
    for sequence, response in enumerate(responses):
        assert torch.equal(kept[sequence, : response.numel(), 0], response)
        assert bool((kept[sequence, response.numel() :] == -1).all())
        for ids in kept[sequence, : response.numel()]:
            valid = ids[ids >= 0]
            assert bool((ids[valid.numel() :] == -1).all())  # padding after the ids
            assert valid.unique().numel() == valid.numel() and bool((valid < 1000).all())
            sizes.append(valid.numel())
    assert 1 <= min(sizes) and max(sizes) <= 50 and len(set(sizes)) > 5  # sizes vary, as top-p's do


def test_a_reference_kept_on_the_host_is_a_copy_and_compares_where_the_other_sample_lives():
    """The reference's gradients go to the host (`to_cpu`: on the GPU they were held twice beside a second 7B model
    and ran legacy out of memory on an 80 GB card): a copy even on the CPU, where megatron's DDP zeroes its gradient
    buffer in place for the next step, and compared on the other sample's device."""
    from verl_fused_hook_harness.commands.e2e.common import snapshot_gradients
    from verl_fused_hook_harness.support.compare import worst_gradient

    layer = torch.nn.Linear(3, 2)
    layer.weight.main_grad = torch.full((2, 3), 2.0)
    layer.bias.grad = torch.ones(2)
    kept = snapshot_gradients(layer, to_cpu=True)
    layer.weight.main_grad.zero_()
    layer.bias.grad.mul_(4.0)
    assert torch.equal(kept["weight"], torch.full((2, 3), 2.0)) and torch.equal(kept["bias"], torch.ones(2))
    later = snapshot_gradients(layer)
    assert worst_gradient(kept, later) == (3.0, "bias")
    assert worst_gradient(kept, later, relative=True) == (3.0, "bias")
