"""The commands' notice collector (support/upstream_notices.py): known upstream lines counted and summarised, every
other line passed on unchanged, a child process's lines included, and nothing touched with `verbose`."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading
import time
import types

from verl_fused_hook_harness.support import upstream_notices
from verl_fused_hook_harness.support.upstream_notices import UpstreamNotices

WARNING = (
    b"/venv/site-packages/megatron/core/models/backends.py:34: UserWarning: Apex is not installed. Falling back "
    b"to Torch Norm\n  warnings.warn(\n"
)
OWN = b"INFO:2026-01-01 00:00:00,000:verl_fused_hook: MegatronEngineWithLMHead uses the output_processor hook\n"


def _noise_and_results():
    """A command's output. Its own lines go to fd 1 as a command's `print` does: under pytest's capfd `print` writes
    to the capture file directly, past the collector, and would race the lines the collector passes on."""
    os.write(1, b"result 1\n")
    os.write(2, WARNING)
    os.write(1, b"[GPTModel(\n  (embedding): LanguageModelEmbedding()\n)]\n")  # verl's patch_engine_mtp print
    os.write(2, OWN * 3)
    os.write(2, b"  an indented line of the command's own\n")
    child = "import warnings; warnings.warn('Transformer Engine and Apex are not installed.'); print('child result')"
    subprocess.run([sys.executable, "-c", child], check=True)  # inherits the command's stdout and stderr
    os.write(1, b"PASS\n")


def test_known_notices_are_counted_and_everything_else_passes(capfd):
    with UpstreamNotices() as notices:
        _noise_and_results()
    out, err = capfd.readouterr()
    assert out.splitlines() == ["result 1", "child result", "PASS"]
    lines = err.splitlines()
    assert lines[:2] == [OWN.decode().rstrip(), "  an indented line of the command's own"]  # shown once
    assert lines[2:] == [
        "upstream notices: 3 hidden (Apex/TE fallbacks x2, verl model prints x1); "
        "verl_fused_hook log lines repeated: 2 hidden; --verbose shows them"
    ]
    assert notices.counts["Apex/TE fallbacks"] == 2


def test_verbose_changes_nothing(capfd):
    with UpstreamNotices(verbose=True):
        _noise_and_results()
    out, err = capfd.readouterr()
    assert "[GPTModel(" in out and "PASS" in out
    assert "Apex is not installed" in err and err.count("verl_fused_hook: MegatronEngineWithLMHead") == 3
    assert "upstream notices" not in err


def test_model_prints_of_two_ranks_interleaved_stay_hidden(capfd):
    """Two ranks print the model at once; a write past the pipe's atomic size lands inside the other's print."""
    with UpstreamNotices() as notices:
        os.write(
            1,
            b"[GPTModel(\n  (embedding): LanguageModelEmbedding(\n    (word_emb[GPTModel(\n  (embedding): X\n)]\n"
            b"eddings): VocabParallelEmbedding()\n  )\n)]\n",
        )
        os.write(1, b"result\n")
    out, err = capfd.readouterr()
    assert out == "result\n" and notices.counts["verl model prints"] == 2


def test_lines_written_as_the_block_ends_are_passed_on(capfd, monkeypatch):
    """A reader whose wait timed out just before the command's last lines were written, and whose thread runs again
    only after the block has ended (a loaded 2-core machine; most likely how train-parity lost its PASS line once in
    CI), still passes them on. The stand-in `select` holds each timed-out wait until the block has ended."""
    notices = UpstreamNotices()
    held = threading.Event()
    real_select = select.select

    def select_held_after_timeout(read, write, error, timeout):
        ready = real_select(read, write, error, timeout)
        if not ready[0] and held.is_set():
            notices._stopping.wait()
        return ready

    monkeypatch.setattr(upstream_notices, "select", types.SimpleNamespace(select=select_held_after_timeout))
    with notices:
        held.set()
        time.sleep(0.5)  # both readers' waits time out and are held
        os.write(1, b"result\n")
        os.write(1, b"PASS\n")
    out, _ = capfd.readouterr()
    assert out == "result\nPASS\n"
