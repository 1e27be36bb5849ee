"""How `bench` times work on the GPU: CUDA events, warm-ups, medians, and the methods of one shape in rounds.

Why rounds: the H200's clocks drift under sustained load (power and heat), by a few percent over a minute. Timing
one method's repeats after another's hands that drift to whichever ran first or last; timed A, B, C, A, B, C, ...
every method meets the same drift, so the ratios between methods (and to the floor) are fair in one run.

Why back-to-back calls (`calls`): the card sits at its power cap and lowers its clock to stay there. Between two
timings it waits for the host, and a step of ~60 ms after such a pause can run at a higher clock than the same
step inside a training step, where the GPU never pauses. Timing several calls back to back, with no wait between
them, holds the card at the cap as a training step does; the time per call is reported.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

SLOW_MS = 1000.0  # a method this slow gets one warm-up and at most three timed repeats


def event_ms(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def time_ms(fn: Callable[[], object], warmup: int, repeats: int, calls: int = 1) -> float:
    """Median of `repeats` CUDA-event timings after `warmup` untimed ones (one step's `time_in_rounds`)."""
    return time_in_rounds({"fn": fn}, warmup, repeats, lambda name, thunk: thunk(), calls=calls)["fn"]


def back_to_back(step: Callable[[], object], calls: int) -> Callable[[], None]:
    """The step `calls` times in a row, nothing waited for between them."""

    def run() -> None:
        for _ in range(calls):
            step()

    return run


def time_in_rounds(
    steps: dict[str, Callable[[], object]],
    warmup: int,
    repeats: int,
    guard: Callable[[str, Callable[[], object]], object],
    clock: Callable[[str, Callable[[], object]], float] | None = None,
    calls: int = 1,
) -> dict[str, object]:
    """Each step's median time in ms, its repeats taken in rounds over the steps, or what `guard` (name, thunk)
    returned for a step that failed (it then leaves the rounds). Each timing (warm-ups too) runs the step `calls`
    times back to back and is divided by `calls`: the time per call. The first warm-up is timed: a step slower
    than SLOW_MS a call gets no other and at most three timed repeats. `clock(name, step)`: runs the step once
    and returns its ms (default: CUDA events; clocks.ClockMeter.clock also files the SM clock under the
    name); warm-ups pass name None, so nothing of a warm-up (a JIT compile with the GPU idle, say) is filed under
    the step."""
    if calls < 1:
        raise ValueError(f"calls: must be >= 1, got {calls}")
    clock = clock or (lambda name, step: event_ms(step))

    def per_call(name: str | None, step: Callable[[], object]) -> float:
        return clock(name, back_to_back(step, calls)) / calls

    result: dict[str, object] = {}
    times: dict[str, list[float]] = {}
    allowed: dict[str, int] = {}
    for name, step in steps.items():
        first = guard(name, lambda: per_call(None, step)) if warmup > 0 else 0.0
        outcome = first
        for _ in range(warmup - 1 if isinstance(first, float) and first <= SLOW_MS else 0):
            outcome = guard(name, lambda: per_call(None, step))  # a warm-up that fails is a failure like a timed one
            if not isinstance(outcome, float):
                break
        if not isinstance(outcome, float):
            result[name] = outcome
            continue
        times[name], allowed[name] = [], repeats if first <= SLOW_MS else min(repeats, 3)
    for round_ in range(repeats):
        for name in list(times):
            if round_ >= allowed[name] or name in result:
                continue
            timed = guard(name, lambda: per_call(name, steps[name]))
            if isinstance(timed, float):
                times[name].append(timed)
            else:
                result[name] = timed
    for name, taken in times.items():
        if name not in result:
            result[name] = statistics.median(taken)
    return {name: result[name] for name in steps}


def settle_clocks(seconds: float = 10.0) -> None:
    """Run matrix products until the GPU's clocks settle under load: a cold GPU
    flatters whatever runs first, the floor included."""
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    end_ms, spent = seconds * 1000, 0.0
    while spent < end_ms:
        spent += event_ms(lambda: [a @ a for _ in range(10)])
