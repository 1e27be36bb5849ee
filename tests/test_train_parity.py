"""The train-parity command (`verl-fused-hook train-parity`) on the CPU: K GRPO steps through verl's Megatron engine
in each mode, gloo, TP=1 and TP=2, with a checkpoint at K/2 resumed in fresh processes, offload on and off.

On the CPU every mode computes with the portable op (legacy's Triton kernel is swapped for it), so the modes must
train identically, bit for bit: loss, gradient norm and a checksum of every parameter after every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_fused_hook.testing.grpo_batches import RolloutShape, packed, rollout
from verl_fused_hook.tools import train_parity

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "verl_fused_hook.cli", "train-parity"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
STEPS = 4
FIELDS = ("loss", "grad_norm", "param_checksum")


def run_command(out: Path, *args):
    command = [*COMMAND, "--device", "cpu", "--steps", str(STEPS), "--out", str(out), *args]
    done = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800)  # minutes on an idle 2-core machine; more when it is shared
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((out / "train_parity.json").read_text()), done.stdout


def values(rows, steps=None):
    return [tuple(row[f] for f in FIELDS) for row in rows if steps is None or row["step"] in steps]


def assert_trains(rows):
    """Real optimizer steps: finite losses, non-zero gradient norms, parameters that change every step."""
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(row["loss"])) and row["grad_norm"] > 0 for row in rows)
    assert len({row["param_checksum"] for row in rows}) == STEPS


@pytest.mark.parametrize(
    "tp, modes, offload",
    [
        (1, "legacy,hook-auto,hook-auto-mask", "both"),
        (2, "legacy,hook-auto,hook-auto-mask", "off"),  # TP=2 with sequence parallelism (mbridge's default)
    ],
)
def test_modes_train_identically_and_resume_exactly(tmp_path, tp, modes, offload):
    report, stdout = run_command(tmp_path, "--tp", str(tp), "--modes", modes, "--offload", offload)
    runs = report["runs"]
    legacy = runs["legacy/offload-off"]
    assert_trains(legacy)
    after_checkpoint = set(range(STEPS // 2 + 1, STEPS + 1))
    for mode in modes.split(","):
        plain = runs[f"{mode}/offload-off"]
        assert values(plain) == values(legacy), f"{mode} trains differently from legacy"
        resumed = runs[f"{mode}/resumed"]
        assert [row["step"] for row in resumed] == sorted(after_checkpoint)
        assert values(resumed) == values(plain, after_checkpoint), f"{mode}: resume differs from the uninterrupted run"
        if offload == "both":
            assert values(runs[f"{mode}/offload-on"]) == values(plain), f"{mode}: offload changes training"
    assert report["evaluation"]["match"]
    assert stdout.rstrip().endswith("PASS")
    assert (tmp_path / "train_parity.md").read_text().count("| PASS") == len(report["evaluation"]["checks"])
    assert (tmp_path / "train_parity.png").stat().st_size > 0


def test_rollout_is_grpo_shaped_and_uses_verls_advantages():
    shape = RolloutShape(prompts=3, n=5, prompt_lengths=(2, 6), response_lengths=(1, 7))
    fields = rollout(shape, vocab_size=50, seed=7, step=3)
    assert fields["input_ids"].shape[0] == 15
    prompt_lens = fields["attention_mask"][:, : fields["prompts"].shape[1]].sum(dim=1)
    response_lens = fields["response_mask"].sum(dim=1)
    for group in range(3):  # n responses share one prompt, their lengths vary
        rows = slice(group * 5, (group + 1) * 5)
        assert torch.equal(fields["prompts"][rows], fields["prompts"][rows][:1].expand(5, -1))
        assert prompt_lens[rows].unique().numel() == 1
        advantages = fields["advantages"][rows, 0]
        assert abs(advantages.mean().item()) < 1e-5  # GRPO: normalised within the group
    assert response_lens.unique().numel() > 1
    again = rollout(shape, vocab_size=50, seed=7, step=3)
    assert all(torch.equal(fields[k], again[k]) for k in fields)  # every process and mode sees the same batch
    data = packed(fields, temperature=1.0, use_dynamic_bsz=False)
    assert data["input_ids"].is_nested
    assert data["input_ids"].offsets().diff().tolist() == (prompt_lens + response_lens).tolist()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "3"], "--steps 3: expected an even number"),
        (["--modes", "hook-verl"], "hook-verl runs verl's Triton kernel and needs CUDA"),
        (["--modes", "legacy,fast"], "--modes: unknown ['fast']"),
        (["--micro-batch", "3"], "--micro-batch 3: must divide prompts*n = 10"),
        (["--prompt-lengths", "5"], "--prompt-lengths: expected LO,HI"),
        (["--response-lengths", "4,2"], "RolloutShape.response_lengths: expected 1 <= low <= high"),
    ],
)
def test_bad_arguments_name_the_field(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        train_parity.parse_plan(["--device", "cpu", *args], str(tmp_path))
    assert message in capsys.readouterr().err
