"""The bench's report from a finished run's JSON (`bench --plot-only`): runs on the CPU, no GPU needed."""

import json

import pytest
import torch
from table_titles import assert_every_table_names

from verl_fused_hook_harness.commands.bench import op_bench as bench


def _run(tmp_path):
    results = {
        "device": "NVIDIA H200",
        "torch": "2.11",
        "command": "verl-fused-hook bench",
        "temperature": 0.7,
        "methods": ["floor", "triton", "fused_loss", "verl_loss"],
        "held_gib": None,
        "shapes": [
            {
                "N": 8192,
                "H": 4096,
                "V": 151936,
                "floor": {"gemm_ms": 14.0, "dx_ms": 14.5, "dw_ms": 14.5, "fwd_bwd_ms": 57.0, "fwd_bwd_3gemm_ms": 43.0},
                "triton": {"fwd_bwd_ms": 61.0, "extra_gib": 0.25, "fwd_ms": 16.0},
                "fused_loss": {
                    "fwd_bwd_ms": "out of memory: CUDA out of memory. Tried to allocate 2.32 GiB.",
                    "fwd_ms": 18.0,
                },
                "verl_loss": {"fwd_bwd_ms": 98.0, "extra_gib": 0.29, "fwd_ms": None},
            }
        ],
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(results))
    return path


def test_plot_only_redraws_and_prints_the_tables_marking_out_of_memory(tmp_path, capsys):
    assert bench.main(["--plot-only", str(_run(tmp_path)), "--out", str(tmp_path / "plot")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "plot.png").stat().st_size > 1000
    assert "61.0 ms (1.07x)" in out  # ratio to the four-GEMM floor of the same run
    assert "OOM" in out and "98.0 ms (1.72x)" in out
    assert "n/a" in out  # a forward that was not measured is said to be missing, not shown as a number
    assert_every_table_names(out, "NVIDIA H200", 2)  # forward+backward, forward alone
    assert "fused_loss speed-up over verl_loss (verl's kernel + its ppo_loss) on NVIDIA H200:" in out


def test_every_table_names_the_card(tmp_path, capsys):
    """Issue 55: a ratio read on one card does not hold on another (the forward over one GEMM: 1.04-1.09x on an
    H200, 1.18-1.51x on an H100), so each table of a run (here all five: forward+backward, forward alone, half
    masked, clocks, accuracy) says which card it was read on, in the markdown file and on stdout alike."""
    path = _run(tmp_path)
    results = json.loads(path.read_text())
    results["device"] = "NVIDIA H100 80GB HBM3"
    results["shapes"][0]["triton"] |= {"half_masked_fwd_bwd_ms": 31.0, "sm_clock_mhz": 1680.0, "power_w": 459.0}
    results["accuracy_shape"] = [2048, 4096, 151936]
    errors = ("log_prob_max_err", "entropy_max_err", "d_hidden_rel_err", "d_weight_rel_err")
    results["accuracy"] = {"triton": dict.fromkeys(errors, 1e-6)}
    path.write_text(json.dumps(results))
    assert bench.main(["--plot-only", str(path), "--out", str(tmp_path / "plot")]) == 0
    assert_every_table_names(capsys.readouterr().out, "NVIDIA H100 80GB HBM3", 5)


def test_the_forward_table_takes_the_one_gemm_timed_in_the_same_rounds(tmp_path, capsys):
    """A run with the forward's own rounds: the ratio is to that GEMM (16.0 ms), not to the floor's (14.0 ms)."""
    path = _run(tmp_path)
    results = json.loads(path.read_text())
    results["shapes"][0]["one_gemm_in_rounds_ms"] = 16.0
    path.write_text(json.dumps(results))
    assert bench.main(["--plot-only", str(path), "--out", str(tmp_path / "plot")]) == 0
    out = capsys.readouterr().out
    assert (
        "Forward without gradient on NVIDIA H200 (ratio to one GEMM, timed in the same rounds where the run has it):"
        in out
    )
    assert "| 8192, 4096, 151936 | 16.0 ms | 16.0 ms (1.00x) | 18.0 ms (1.12x) | n/a |" in out
    results["shapes"][0]["one_gemm_in_rounds_ms"] = "out of memory: CUDA out of memory."  # the floor's GEMM then
    path.write_text(json.dumps(results))
    assert bench.main(["--plot-only", str(path), "--out", str(tmp_path / "plot")]) == 0
    assert "| 8192, 4096, 151936 | 14.0 ms | 16.0 ms (1.14x) | 18.0 ms (1.29x) | n/a |" in capsys.readouterr().out


def test_the_forward_table_shows_each_steps_clock_where_the_run_read_one(tmp_path, capsys):
    """Issue 55: on an H100 at its power cap the GEMM and the op ran at 1965 and 1485 MHz in the same rounds (a
    ratio read 1.23x that the same op gave 1.05x in another run), so the forward table prints each step's median
    clock beside its time; a step without readings (shorter than NVML's interval) shows none."""
    path = _run(tmp_path)
    results = json.loads(path.read_text())
    row = results["shapes"][0]
    row["one_gemm_in_rounds_ms"] = 16.0
    row["one_gemm_in_rounds_clock"] = {"sm_clock_mhz": 1965.0, "power_w": 686.0, "clock_samples": 63}
    row["triton"]["fwd_clock"] = {"sm_clock_mhz": 1485.0, "power_w": 695.0, "clock_samples": 81}
    row["fused_loss"]["fwd_clock"] = {}
    path.write_text(json.dumps(results))
    assert bench.main(["--plot-only", str(path), "--out", str(tmp_path / "plot")]) == 0
    out = capsys.readouterr().out
    assert "| 8192, 4096, 151936 | 16.0 ms, 1965 MHz | 16.0 ms (1.00x), 1485 MHz | 18.0 ms (1.12x) | n/a |" in out


def test_the_plot_title_folds_a_long_command_within_the_figure_width_and_keeps_all_of_it():
    from verl_fused_hook_harness.commands.bench.report import TITLE_CHARACTERS_PER_INCH, figure_title

    shapes = ";".join(f"{n},4096,151936" for n in (8192, 16384, 32768, 65536, 131072, 262144))
    command = f"verl-fused-hook bench --shapes {shapes} --methods floor,triton,liger_sm90 --out /root/out/run"
    results = {"device": "NVIDIA H200", "temperature": 0.7, "command": command}
    title = figure_title(results, 12.0)
    lines = title.splitlines()
    assert len(lines) >= 2 and max(map(len, lines)) <= 12 * TITLE_CHARACTERS_PER_INCH  # 168 characters a line
    assert " ".join(lines) == f"NVIDIA H200, bf16, T=0.7: {command}"  # folded at spaces, nothing dropped


def test_chunk_plans_records_what_the_fused_loss_planned_and_restores_the_logger():
    import logging

    import torch

    from verl_fused_hook.ops import log_probs_entropy_and_loss
    from verl_fused_hook_harness.commands.bench.held_memory import ChunkPlans

    chunking_logger = logging.getLogger("verl_fused_hook.ops.chunking")
    level = chunking_logger.level
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 8, generator=g, requires_grad=True)
    weight = torch.randn(37, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 37, (300,), generator=g)
    with ChunkPlans() as plans:
        for _ in range(2):  # the same plan twice: recorded once
            result = log_probs_entropy_and_loss(
                hidden,
                weight,
                labels,
                loss_fn=lambda lp, ent: (lp.sum(), {}),
                loss_name="sum",
                backend="torch",
                chunk_rows=128,
            )
            result.loss.backward()
        lines = plans.take()
    assert lines == [
        "log_probs_entropy_and_loss: loss sum: 300 scored rows in 3 chunks of up to 128 rows (set by chunk_rows=128)"
    ]
    assert plans.take() == [] and chunking_logger.level == level and plans not in chunking_logger.handlers


def test_liger_hopper_methods_are_skipped_with_their_reason_where_they_cannot_run(capsys):
    """On this CPU-only machine neither Liger Hopper kernel can run: each is left out with the reason, never
    replaced by Liger's slower fallback under the same name."""
    from verl_fused_hook_harness.commands.bench.methods import load_methods

    skipped = {}
    methods = load_methods(["liger_sm90", "liger_tp_native", "naive"], None, skipped)
    assert list(methods) == ["naive"]
    assert set(skipped) == {"liger_sm90", "liger_tp_native"}
    for reason in skipped.values():  # liger-kernel absent, or present without a GPU
        assert reason == "liger-kernel is not installed" or reason.startswith("needs a CUDA GPU"), reason
    out = capsys.readouterr().out
    assert all(f"# {name}: {reason}; skipped" in out for name, reason in skipped.items())


def test_a_peer_limited_per_call_runs_as_calls_of_at_most_its_rows_with_the_same_values_and_gradients():
    """liger_tp_native refuses 32768 tokens or more per call; bench runs larger N as calls of at most 16384 rows.
    Stand-in for Liger's GPU kernel (it cannot run here): an fp64 torch log-softmax per call. Split into 3 calls of
    at most 5 rows, the 13 rows' log-probs, entropy and both gradients equal one call's to fp64 rounding."""
    from verl_fused_hook_harness.commands.bench.liger_hopper import in_calls_of_at_most

    calls = []

    def torch_stand_in(h, w, labels, temperature):
        calls.append(h.shape[0])
        log_p = torch.log_softmax(h @ w.T / temperature, dim=-1)
        return log_p.gather(1, labels[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)

    generator = torch.Generator().manual_seed(0)
    h0 = torch.randn(13, 8, dtype=torch.float64, generator=generator)
    w0 = torch.randn(11, 8, dtype=torch.float64, generator=generator)
    labels = torch.randint(0, 11, (13,), generator=generator)
    g_lp, g_ent = (torch.randn(13, dtype=torch.float64, generator=generator) for _ in range(2))
    results = []
    for fn in (torch_stand_in, in_calls_of_at_most(5, torch_stand_in)):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        log_probs, entropy = fn(h, w, labels, 0.7)
        ((log_probs * g_lp).sum() + (entropy * g_ent).sum()).backward()
        results.append((log_probs.detach(), entropy.detach(), h.grad, w.grad))
    assert calls == [13, 5, 5, 3]
    for whole, split in zip(*results):
        torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-12)


def test_the_report_says_which_methods_were_skipped_and_why(tmp_path, capsys):
    run = json.loads(_run(tmp_path).read_text())
    run["skipped"] = {
        "liger_sm90": "its sm90 kernel cannot be imported (No module named 'cutlass'): pip install nvidia-cutlass-dsl"
    }
    path = tmp_path / "skipped.json"
    path.write_text(json.dumps(run))
    assert bench.main(["--plot-only", str(path), "--out", str(tmp_path / "plot")]) == 0
    assert (
        "Skipped liger_sm90: its sm90 kernel cannot be imported (No module named 'cutlass')" in capsys.readouterr().out
    )


def test_bench_times_the_methods_in_rounds_and_drops_a_failed_one():
    """bench's timing.time_in_rounds on a clock that only counts (no GPU): warm-ups first, then the timed repeats in
    rounds A, B, C, A, B, C; a step failing in a round leaves the rounds with its reason; a slow step (warm-up past
    SLOW_MS) gets at most three repeats."""
    from verl_fused_hook_harness.commands.bench.timing import SLOW_MS, time_in_rounds

    order, calls = [], {"a": 0, "b": 0, "slow": 0, "bad": 0}

    def step(name):
        def run():
            calls[name] += 1
            order.append(name)
            if name == "bad" and calls[name] == 3:
                raise RuntimeError("refused")

        return run

    def clock(name, thunk):
        thunk()
        return SLOW_MS + 1 if order[-1] == "slow" else float(len(order))

    def guard(name, thunk):
        try:
            return thunk()
        except RuntimeError as error:
            return f"RuntimeError: {error}"

    result = time_in_rounds({n: step(n) for n in calls}, warmup=2, repeats=5, guard=guard, clock=clock)
    warm = order[:7]  # a: 2, b: 2, slow: 1 (slow), bad: 2
    assert warm == ["a", "a", "b", "b", "slow", "bad", "bad"]
    timed = order[7:]
    assert timed[:4] == ["a", "b", "slow", "bad"] and timed[4:7] == ["a", "b", "slow"]  # bad failed in round 1
    assert calls == {"a": 7, "b": 7, "slow": 4, "bad": 3}
    assert result["bad"] == "RuntimeError: refused"
    assert result["slow"] == SLOW_MS + 1
    timed_a = [i + 1 for i, n in enumerate(order) if n == "a"][2:]  # the clock's readings of a's timed repeats
    assert result["a"] == float(sorted(timed_a)[len(timed_a) // 2])  # their median


def test_bench_records_a_step_that_fails_in_a_later_warm_up():
    """A step whose second warm-up fails leaves with its reason (the run goes on); the others are timed."""
    from verl_fused_hook_harness.commands.bench.timing import time_in_rounds

    calls = {"ok": 0, "late": 0}

    def step(name):
        def run():
            calls[name] += 1
            if name == "late" and calls[name] == 2:
                raise RuntimeError("out of room")

        return run

    def guard(name, thunk):
        try:
            return thunk()
        except RuntimeError as error:
            return f"RuntimeError: {error}"

    result = time_in_rounds(
        {n: step(n) for n in calls}, warmup=3, repeats=4, guard=guard, clock=lambda name, thunk: (thunk(), 2.0)[1]
    )
    assert result == {"ok": 2.0, "late": "RuntimeError: out of room"}
    assert calls == {"ok": 7, "late": 2}


def test_bench_times_back_to_back_calls_and_reports_the_time_per_call():
    """--back-to-back K: each timing (warm-ups too) runs the step K times with nothing between them, and the time
    per call is what is kept; SLOW_MS applies per call (K calls past it, one call under it: every repeat)."""
    from verl_fused_hook_harness.commands.bench.timing import SLOW_MS, time_in_rounds

    runs = {"fast": 0, "slow": 0}
    per_run_ms = {"fast": 10.0, "slow": SLOW_MS / 2}  # two slow calls take > SLOW_MS, one call does not

    def step(name):
        def run():
            runs[name] += 1

        return run

    def clock(name, thunk):  # the timing of one thunk: what it ran, at per_run_ms a run
        before = dict(runs)
        thunk()
        return sum((runs[n] - before[n]) * per_run_ms[n] for n in runs)

    result = time_in_rounds(
        {n: step(n) for n in runs}, warmup=2, repeats=5, guard=lambda name, thunk: thunk(), clock=clock, calls=3
    )
    assert result == {"fast": 10.0, "slow": SLOW_MS / 2}
    assert runs == {"fast": 3 * (2 + 5), "slow": 3 * (2 + 5)}  # per call under SLOW_MS: every warm-up and repeat
    with pytest.raises(ValueError, match="calls: must be >= 1, got 0"):
        time_in_rounds({"fast": step("fast")}, 1, 1, guard=lambda name, thunk: thunk(), clock=clock, calls=0)


def test_the_report_says_when_timings_ran_calls_back_to_back(tmp_path, capsys):
    run = json.loads(_run(tmp_path).read_text()) | {"back_to_back": 6}
    path = tmp_path / "b2b.json"
    path.write_text(json.dumps(run))
    assert bench.main(["--plot-only", str(path), "--out", str(tmp_path / "plot")]) == 0
    assert "Each timing: 6 calls back to back" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--back-to-back", "0"])
    assert "--back-to-back: must be >= 1, got 0" in capsys.readouterr().err
