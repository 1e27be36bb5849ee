"""`verl-fused-hook <command> [args]`: the installed entry point for the tools in `verl_fused_hook_harness.commands`.

Why one dispatcher: the A/B script and the benchmarks must come with `pip install`, not only with a clone,
and each tool's module stays importable (tests call their functions) without importing the others.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "ab-parity": (
        "verl_fused_hook_harness.commands.ab.parity",
        "hook mode vs verl's legacy fused forward on identical weights and batch",
    ),
    "bench": (
        "verl_fused_hook_harness.commands.bench.op_bench",
        "the op against its peers and the cuBLAS GEMM floor (CUDA)",
    ),
    "e2e-bench": ("verl_fused_hook_harness.commands.e2e.bench", "verl's engine forward+backward in each mode (CUDA)"),
    "train-parity": (
        "verl_fused_hook_harness.commands.train.parity",
        "K GRPO steps through verl's engine per mode, checkpoint/resume",
    ),
    "replay-learning": (
        "verl_fused_hook_harness.commands.train.replay_learning",
        "GRPO on self-sampled top-k/top-p rollouts: legacy, hook, hook with sampling replay",
    ),
    "doctor": (
        "verl_fused_hook_harness.commands.doctor",
        "what the plugin will do on this machine: versions, hook probe, backend, entry point, plan, op self-check",
    ),
}


def _usage() -> str:
    lines = [
        "usage: verl-fused-hook <command> [args]   (verl-fused-hook <command> --help for its arguments)",
        "",
        "commands:",
    ]
    lines += [f"  {name:<12} {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"verl-fused-hook: unknown command {name!r}; allowed: {', '.join(COMMANDS)}\n\n{_usage()}", file=sys.stderr
        )
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    sys.argv[0] = f"verl-fused-hook {name}"  # argparse's prog in the tool's usage and error lines
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
