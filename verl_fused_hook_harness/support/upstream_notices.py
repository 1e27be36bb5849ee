"""Known upstream notices (warnings, log lines, prints of megatron-core, verl, mbridge, torch) collected inside a
command and summarised in one line, so the command prints its result, not the noise.

Why at the file descriptors: the notices come from Python warnings, from loggers whose handlers were created at
import time, from C++ (torch's glog-style lines) and from the command's worker processes, which inherit the
command's stdout and stderr. `UpstreamNotices` points fds 1 and 2 of the command's process at pipes for the
duration of the command (worker processes started inside inherit them); a reader thread per pipe passes every
other line on unchanged and counts the known ones by what they are. Only the harness commands use it: the
runtime never does, so a user's training job prints everything as before. `--verbose` turns it off.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing.resource_tracker
import os
import re
import select
import sys
import threading

# This package's own INFO lines (one per engine build and rank): each message is shown once, its repeats are
# counted apart.
OWN_LOG_LINES = "verl_fused_hook log lines repeated"
OWN_LOG_LINE = re.compile(r"^INFO:.*?verl_fused_hook: (.*)$")
# (what the notice is, a pattern of its first line). Order matters: the first match names the line.
KNOWN = (
    ("megatron GPTModel deprecation", r"GPTModel IS DEPRECATED"),
    ("Apex/TE fallbacks", r"Transformer Engine and Apex are not installed|Apex is not installed"),
    ("verl optional engines missing", r"engine is not available: ModuleNotFoundError"),
    ("verl accelerator probe", r"No supported accelerator detected|\(PlatformCUDA\) is registered but not available"),
    ("torch no-CUDA notice", r"No CUDA runtime is found"),
    (
        "torch deprecations",
        r"`torch\.distributed\.\w+` is deprecated|is_fx_tracing will return true|deprecating "
        r"ShardedTensor|TypedStorage is deprecated|argument order of load has been changed|torch\.distributed is "
        r"disabled, unavailable or uninitialized|\.grad attribute of a Tensor that is not a leaf",
    ),
    (
        "megatron config notices",
        r"full scope is deprecated|CUDA_DEVICE_MAX_CONNECTIONS|set sequence "
        r"parallel to false as TP size is 1|full_param_layout not provided|MimoModelConfig is experimental|async save "
        r"is "
        r"deprecated",
    ),
    ("verl MTP patch", r"Applying mtp patch"),
    ("verl fused kernels off (MTP, padding)", r"Fused kernels require remove-padding"),
    ("verl legacy mbridge deprecation", r"legacy mbridge backend selected by `vanilla_mbridge=True` is deprecated"),
    # prints of several ranks interleave on stdout: these patterns do not anchor at the line's start
    ("verl TransformerConfig dumps", r"TransformerConfig\(tensor_model_parallel_size="),
    ("megatron parameter counts", r"> number of parameters on \(tensor, pipeline\) model parallel rank"),
    ("checkpoint progress", r"\[Rank \d+\] (Loaded|Wrote|Checkpoint save|model/dist_ckpt will save)"),
    ("verl optimizer config dumps", r"optimizer config after override: "),
)
# verl's `patch_engine_mtp` prints the model list, "[GPTModel(" to ")]", one per rank. Ranks print at once and
# writes past the pipe's atomic size interleave, so the markers are counted wherever they appear in a line.
PRINTED_MODEL, MODEL_START, MODEL_END = "verl model prints", "[GPTModel(", ")]"
# A Python warning is a header line ("path:line: SomeWarning: message") and the source line, indented.
WARNING_HEADER = re.compile(r"^\S.*:\d+: \w*Warning: ")


class UpstreamNotices:
    """Within the block, known upstream notices on this process's stdout and stderr (its workers' included)
        are counted, not printed; on exit one summary line goes to stderr (none when nothing was hidden). Of this
    package's own INFO lines each message is printed once. Nothing changes when `verbose`."""

    def __init__(self, verbose: bool = False):
        self.verbose = verbose
        self.counts: collections.Counter[str] = collections.Counter()
        self._patterns = [(label, re.compile(pattern)) for label, pattern in KNOWN]
        self._saved: dict[int, int] = {}
        self._readers: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._own_messages: set[str] = set()

    def __enter__(self):
        if self.verbose:
            return self
        # The tracker outlives the command's workers; started now it keeps the real stdout/stderr, not a pipe.
        multiprocessing.resource_tracker.ensure_running()
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            self._saved[fd] = os.dup(fd)
            read, write = os.pipe()
            os.dup2(write, fd)
            os.close(write)
            reader = threading.Thread(target=self._pump, args=(read, self._saved[fd]), daemon=True)
            reader.start()
            self._readers.append(reader)
        return self

    def __exit__(self, *exc):
        if self.verbose:
            return False
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # closes this process's write end of the pipe
        self._stopping.set()
        for reader in self._readers:
            reader.join(timeout=30)
        for saved in self._saved.values():
            os.close(saved)
        summary = self.summary()
        if summary:
            print(summary, file=sys.stderr, flush=True)
        return False

    def summary(self) -> str | None:
        """One line: how many notices were hidden and what they were; None when none were."""
        upstream = [(label, count) for label, count in self.counts.most_common() if label != OWN_LOG_LINES]
        own = self.counts.get(OWN_LOG_LINES, 0)
        parts = []
        if upstream:
            kinds = ", ".join(f"{label} x{count}" for label, count in upstream)
            parts.append(f"upstream notices: {sum(count for _, count in upstream)} hidden ({kinds})")
        if own:
            parts.append(f"{OWN_LOG_LINES}: {own} hidden")
        return "; ".join(parts) + "; --verbose shows them" if parts else None

    def _pump(self, read_fd: int, out_fd: int) -> None:
        """Pass the pipe's lines on to `out_fd`, less the known notices, until the pipe is closed or, once the
        block has ended, quiet (a process that inherited the pipe may hold it open). Quiet means a whole wait begun
        after the block ended: a wait that timed out before the command's last lines were written, its thread run
        again only after the block ended (a loaded machine), must not drop those lines."""
        pending, state = b"", {"open_prints": 0, "source_line": False}
        while True:
            ended = self._stopping.is_set()
            ready, _, _ = select.select([read_fd], [], [], 0.2)
            if not ready:
                if ended:
                    break
                continue
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            kept = [line for line in lines if not self._hidden(line.decode(errors="replace"), state)]
            if kept:
                _write_all(out_fd, b"".join(line + b"\n" for line in kept))
        if pending and not self._hidden(pending.decode(errors="replace"), state):
            _write_all(out_fd, pending)
        os.close(read_fd)

    def _hidden(self, line: str, state: dict) -> bool:
        """Whether `line` is (part of) a known notice; counts each notice once, by its first line."""
        starts = line.count(MODEL_START)
        if starts:
            self._count(PRINTED_MODEL, starts)
        if state["open_prints"] or starts:
            state["open_prints"] = max(0, state["open_prints"] + starts - line.count(MODEL_END))
            return True
        if state["source_line"]:
            state["source_line"] = False
            if line.startswith(" "):
                return True
        own = OWN_LOG_LINE.match(line)
        if own:
            with self._lock:
                repeated = own.group(1) in self._own_messages
                self._own_messages.add(own.group(1))
            if repeated:
                self._count(OWN_LOG_LINES)
            return repeated
        for label, pattern in self._patterns:
            if pattern.search(line):
                state["source_line"] = bool(WARNING_HEADER.match(line))
                self._count(label)
                return True
        return False

    def _count(self, label: str, times: int = 1) -> None:
        with self._lock:
            self.counts[label] += times


def add_verbose_argument(parser) -> None:
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="print upstream warnings and log lines (megatron-core, verl, mbridge, torch) as they come "
        "instead of one summary line",
    )


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


@contextlib.contextmanager
def unprinted_gloo_connections():
    """fd 1 at /dev/null while gloo groups connect. Why: gloo as torch 2.8 bundles it writes "[Gloo] Rank N is
    connected to M peer ranks" to std::cout piece by piece for every rank and group it connects (megatron's parallel
    state connects dozens: 700 lines in the demo), and ranks' pieces interleave, so no line filter can catch them.
    A connection that fails still raises; what Python prints within the block is dropped too."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)
