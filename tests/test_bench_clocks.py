"""bench's SM clock and power readings (commands/bench/clocks.py): filed under the step that ran, summarized, reported.

NVML needs an NVIDIA driver, which this machine lacks: the meter's reading process (a real spawned process)
imports a named stand-in for pynvml here, tests/nvml_stand_in.py, that returns the clock and power the test
writes into a file. The real readings come from bench runs on the GPU (docs/benchmarks.md)."""

from __future__ import annotations

import os
import time

import pytest

from verl_fused_hook_harness.commands.bench.clocks import ClockMeter, clocks_table, megacycles
from verl_fused_hook_harness.commands.bench.nvml_readings import AVERAGE, INSTANT, power_source, read_power
from verl_fused_hook_harness.commands.bench.report import markdown


def _program(reading_file, reading: str) -> None:
    """New values for the stand-in, written whole (the reading process never sees a half-written file)."""
    partial = reading_file.with_suffix(".partial")
    partial.write_text(reading)
    os.replace(partial, reading_file)


def _hold(meter, name, reading_file, reading, seconds=0.08):
    _program(reading_file, reading)
    time.sleep(0.02)  # the reading process's next readings see the new values
    with meter.naming(name):
        time.sleep(seconds)


def _wait_until_reading(meter, reading_file, seconds=60.0, reading="1000,1000") -> None:
    """The spawned process takes a moment to start (longer on a busy machine): wait for its first readings."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        _hold(meter, "start-up", reading_file, reading, seconds=0.05)
        if meter.take("start-up"):
            return
    raise AssertionError(f"the reading process gave no reading within {seconds} s")


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """(a meter whose reading process reads the NVML stand-in, already reading; the stand-in's file). The file's
    two values leave the stand-in without the instantaneous power field: the 1 s average is read."""
    reading_file = tmp_path / "nvml.txt"
    _program(reading_file, "1980,100000")
    monkeypatch.setenv("NVML_STAND_IN_FILE", str(reading_file))
    meter = ClockMeter("GPU-stand-in", AVERAGE, nvml_module="nvml_stand_in", interval_s=0.002)
    try:
        _wait_until_reading(meter, reading_file)
        yield meter, reading_file
    finally:
        meter.close()


def test_readings_are_filed_under_the_step_whose_window_holds_them_and_summarized_as_medians(stand_in):
    meter, reading_file = stand_in
    _hold(meter, "triton", reading_file, "1470,690000")
    _program(reading_file, "1980,90000")  # between steps (idle): never filed
    time.sleep(0.05)
    _hold(meter, "liger_sm90", reading_file, "1560,695000")
    _hold(meter, "triton", reading_file, "1470,690000")
    triton, liger = meter.take("triton"), meter.take("liger_sm90")
    assert meter.take("triton") == {}  # taken once: the next shape starts empty
    meter.close()
    assert triton["sm_clock_mhz"] == 1470 and triton["power_w"] == pytest.approx(690.0)
    assert liger["sm_clock_mhz"] == 1560 and liger["power_w"] == pytest.approx(695.0)
    assert triton["clock_samples"] >= 10 and liger["clock_samples"] >= 5  # ~80 and ~40 at 2 ms on an idle machine
    assert not meter._process.is_alive()


def test_power_is_the_instantaneous_field_where_nvml_answers_it_else_the_one_second_average(tmp_path, monkeypatch):
    import nvml_stand_in

    reading_file = tmp_path / "nvml.txt"
    monkeypatch.setenv("NVML_STAND_IN_FILE", str(reading_file))
    _program(reading_file, "1470,300000,690000")  # a short step after idle: the average lags, the instant does not
    assert power_source(nvml_stand_in, "GPU-stand-in") == INSTANT
    assert read_power(nvml_stand_in, "GPU-stand-in", INSTANT) == pytest.approx(690.0)
    assert read_power(nvml_stand_in, "GPU-stand-in", AVERAGE) == pytest.approx(300.0)
    _program(reading_file, "1470,300000")  # no instantaneous field on this driver
    assert power_source(nvml_stand_in, "GPU-stand-in") == AVERAGE
    with pytest.raises(nvml_stand_in.NVMLError):
        read_power(nvml_stand_in, "GPU-stand-in", INSTANT)


def test_the_reading_process_files_the_instantaneous_power(tmp_path, monkeypatch):
    reading_file = tmp_path / "nvml.txt"
    _program(reading_file, "1980,100000,110000")
    monkeypatch.setenv("NVML_STAND_IN_FILE", str(reading_file))
    meter = ClockMeter("GPU-stand-in", INSTANT, nvml_module="nvml_stand_in", interval_s=0.002)
    try:
        _wait_until_reading(meter, reading_file, reading="1000,1000,1000")  # the instant field answered throughout
        _hold(meter, "kl_topk", reading_file, "1770,350000,690000")
        assert meter.take("kl_topk")["power_w"] == pytest.approx(690.0)
    finally:
        meter.close()


def test_a_reading_process_that_dies_leaves_the_run_going_without_clocks_and_says_so(stand_in, capsys):
    meter, reading_file = stand_in
    _program(reading_file, "not a reading")  # the stand-in raises: the process exits with an error
    deadline = time.time() + 60
    while meter._process.is_alive() and time.time() < deadline:
        time.sleep(0.05)
    with meter.naming("triton"):
        time.sleep(0.02)
    assert meter.take("triton") == {}
    assert "SM clock readings stopped: the reading process exited (code 1)" in capsys.readouterr().out


def test_without_nvml_the_meter_says_why_and_the_report_says_so(tmp_path):
    meter, why = ClockMeter.open()  # no NVIDIA driver here, and maybe no nvidia-ml-py
    assert meter is None
    assert "nvidia-ml-py" in why or "NVML" in why
    results = {
        "methods": ["floor", "triton"],
        "shapes": [{"N": 8, "H": 4, "V": 16, "triton": {"fwd_bwd_ms": 2.0}}],
        "temperature": 0.7,
        "clocks_not_recorded": why,
    }
    assert f"SM clock and power not recorded: {why}." in markdown(results)
    assert clocks_table(results) == []


def test_the_report_gives_each_methods_clock_power_and_cycles_against_the_floors():
    row = {
        "N": 8192,
        "H": 4096,
        "V": 151936,
        "floor": {"fwd_bwd_ms": 60.0, "sm_clock_mhz": 1500.0, "power_w": 690.0},
        "triton": {"fwd_bwd_ms": 61.2, "sm_clock_mhz": 1470.0, "power_w": 691.0},
        "liger_sm90": {"fwd_bwd_ms": 57.0, "sm_clock_mhz": 1600.0, "power_w": 694.0},
        "verl": {"fwd_bwd_ms": "out of memory: ..."},
    }
    results = {
        "methods": ["floor", "triton", "liger_sm90", "verl"],
        "shapes": [row],
        "temperature": 0.7,
        "device": "NVIDIA H100 80GB HBM3",
    }
    table = "\n".join(clocks_table(results))
    assert "SM clock and power during forward+backward on NVIDIA H100 80GB HBM3 (NVML readings" in table
    assert "power 1 s average)" in table  # a run from before the field was read: its power was the average
    assert "power instant)" in "\n".join(clocks_table({**results, "power_reading": INSTANT}))
    assert "| N, H, V | floor | triton | liger_sm90 |" in table  # verl recorded no clock: not a column
    floor_cycles = 60.0 * 1500 / 1e3
    assert megacycles(61.2, 1470.0) == pytest.approx(89.964)
    assert f"1470 MHz, 691 W, 90 Mcycles ({61.2 * 1470 / 1e3 / floor_cycles:.2f}x)" in table
    assert f"1600 MHz, 694 W, 91 Mcycles ({57.0 * 1600 / 1e3 / floor_cycles:.2f}x)" in table
    assert "1500 MHz, 690 W, 90 Mcycles (1.00x)" in table
    assert megacycles("failed", 1500.0) is None and megacycles(1.0, None) is None
    assert "SM clock and power during forward+backward" in markdown(results)
