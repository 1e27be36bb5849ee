"""The train-parity command (`verl-fused-hook train-parity`) on the CPU: K GRPO steps through verl's Megatron engine
in each mode, gloo, TP=1 and TP=2, with a checkpoint at K/2 resumed in fresh processes, offload on and off.

On the CPU every mode computes with the portable op (legacy's Triton kernel is swapped for it), so the modes must
train identically, bit for bit: loss, gradient norm and a checksum of every parameter after every step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_fused_hook_harness.commands.train import parity as train_parity
from verl_fused_hook_harness.commands.train import report as train_parity_report
from verl_fused_hook_harness.support.grpo_batches import RolloutShape, packed, rollout

ROOT = Path(__file__).resolve().parent.parent
COMMAND = [sys.executable, "-m", "verl_fused_hook_harness.cli", "train-parity"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
STEPS = 4
FIELDS = ("loss", "grad_norm", "param_checksum")


def run_command(out: Path, *args):
    command = [*COMMAND, "--device", "cpu", "--steps", str(STEPS), "--out", str(out), *args]
    done = subprocess.run(
        command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1800
    )  # minutes on an idle 2-core machine; more when it is shared
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((out / "train_parity.json").read_text()), done.stdout


def values(rows, steps=None):
    return [tuple(row[f] for f in FIELDS) for row in rows if steps is None or row["step"] in steps]


def assert_trains(rows):
    """Real optimizer steps: finite losses, non-zero gradient norms, parameters that change every step."""
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(torch.isfinite(torch.tensor(row["loss"])) and row["grad_norm"] > 0 for row in rows)
    assert len({row["param_checksum"] for row in rows}) == STEPS


AFTER_CHECKPOINT = set(range(STEPS // 2 + 1, STEPS + 1))
TP1_MODES = "legacy,hook-auto,hook-auto-mask,hook-auto-fused-loss"


@pytest.fixture(scope="module")
def tp1_run(tmp_path_factory):
    """Every CPU mode at TP=1 with offload on and off, the old log-probs in micro-batches of 2 (the update's: 5),
    once for the tests below: (folder, report, stdout)."""
    out = tmp_path_factory.mktemp("train_parity_tp1")
    report, stdout = run_command(
        out, "--tp", "1", "--modes", TP1_MODES, "--offload", "both", "--old-log-prob-micro-batch", "2"
    )
    return out, report, stdout


def assert_identities(out: Path, report: dict, stdout: str, modes: list[str], offload: str):
    """On the CPU every mode but the fused loss computes with the portable op: legacy's numbers bit for bit;
    in every mode the resumed steps and the offload run repeat the uninterrupted run bit for bit."""
    runs = report["runs"]
    legacy = runs["legacy/offload-off"]
    assert_trains(legacy)
    for mode in modes:
        plain = runs[f"{mode}/offload-off"]
        if not train_parity.MODES[mode].fused_loss:
            assert values(plain) == values(legacy), f"{mode} trains differently from legacy"
        resumed = runs[f"{mode}/resumed"]
        assert [row["step"] for row in resumed] == sorted(AFTER_CHECKPOINT)
        assert values(resumed) == values(plain, AFTER_CHECKPOINT), f"{mode}: resume differs from the uninterrupted run"
        if offload == "both":
            assert values(runs[f"{mode}/offload-on"]) == values(plain), f"{mode}: offload changes training"
    assert report["evaluation"]["match"] and not report["evaluation"]["pending"]
    assert stdout.rstrip().endswith("PASS")
    assert (out / "train_parity.md").read_text().count("| PASS") == len(report["evaluation"]["checks"])
    assert (out / "train_parity.png").stat().st_size > 0
    for key in runs:  # each run's wall time printed as it finished
        assert f"[{key}] steps " in stdout


def test_modes_train_identically_and_resume_exactly_tp1(tp1_run):
    assert_identities(*tp1_run, modes=TP1_MODES.split(","), offload="both")


def test_modes_train_identically_and_resume_exactly_tp2(tmp_path):
    """TP=2 with sequence parallelism (mbridge's default)."""
    modes = "legacy,hook-auto,hook-auto-mask"
    report, stdout = run_command(tmp_path, "--tp", "2", "--modes", modes, "--offload", "off")
    assert_identities(tmp_path, report, stdout, modes=modes.split(","), offload="off")


# The fused loss against hook-auto in fp32 (train_parity_report.GAP_BOUNDS): its gradient is formed from the
# same chunk's logits in the forward instead of the backward, so at most fp32 rounding apart per step.
FUSED_LOSS_ATOL, FUSED_GRAD_NORM_RTOL = 1e-6, 1e-5


def test_fused_loss_mode_trains_like_hook_auto_and_resumes_exactly(tp1_run):
    _, report, _ = tp1_run
    runs = report["runs"]
    fused, twin = runs["hook-auto-fused-loss/offload-off"], runs["hook-auto/offload-off"]
    assert_trains(fused)
    micro_batches = 2 * 5 // 5  # the CPU default: 2 prompts x 5 responses, micro-batches of 5
    for key in ("offload-off", "offload-on", "resumed"):  # verl's ppo_loss ran inside the op, every micro-batch
        assert [row["fused_loss_calls"] for row in runs[f"hook-auto-fused-loss/{key}"]] == [micro_batches] * len(
            runs[f"hook-auto-fused-loss/{key}"]
        )
    assert all(row["fused_loss_calls"] == 0 for key in ("legacy", "hook-auto") for row in runs[f"{key}/offload-off"])
    for a, b in zip(twin, fused, strict=True):
        assert abs(a["loss"] - b["loss"]) <= FUSED_LOSS_ATOL, (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= FUSED_GRAD_NORM_RTOL * a["grad_norm"], a["step"]
    assert values(runs["hook-auto-fused-loss/resumed"]) == values(fused, AFTER_CHECKPOINT)
    assert values(runs["hook-auto-fused-loss/offload-on"]) == values(fused)
    checks = {c["check"]: c for c in report["evaluation"]["checks"]}
    twin_check = next(c for name, c in checks.items() if name.startswith("hook-auto-fused-loss vs hook-auto:"))
    assert twin_check["ok"] and twin_check["largest"]["loss_abs"] <= FUSED_LOSS_ATOL
    assert "hook-auto-fused-loss vs hook-auto" in report["evaluation"]["gaps"]


def _split(report: dict, keys) -> dict:
    part = train_parity_report.new_report(report["configuration"])
    part["runs"] = {k: report["runs"][k] for k in keys}
    part["run_info"] = {k: report["run_info"][k] for k in keys}
    return train_parity_report.merge([("part", part)])  # evaluated as that call alone would be


def test_merge_of_split_calls_evaluates_what_one_call_does(tp1_run, tmp_path, capsys):
    """Three calls' reports (modes split, offload on alone without resume) merge into the one-call evaluation."""
    _, report, _ = tp1_run
    keys = list(report["runs"])
    calls = [
        [k for k in keys if k.split("/")[0] in ("legacy", "hook-auto") and not k.endswith("offload-on")],
        [k for k in keys if k.split("/")[0] not in ("legacy", "hook-auto") and not k.endswith("offload-on")],
        [k for k in keys if k.endswith("offload-on")] + ["legacy/offload-off"],  # a run repeated in two calls
    ]
    folders = []
    for index, call in enumerate(calls):
        part = _split(report, call)
        assert part["evaluation"]["match"]
        assert bool(part["evaluation"]["pending"]) == (index > 0)  # the later calls need the first's runs
        folders.append(tmp_path / f"call{index}")
        train_parity_report.write(part, folders[-1])
    merged_dir = tmp_path / "merged"
    assert train_parity.main(["--merge", *map(str, folders), "--out", str(merged_dir)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS")
    merged = json.loads((merged_dir / "train_parity.json").read_text())
    assert merged["runs"] == report["runs"]
    by_name = lambda evaluation: sorted(evaluation["checks"], key=lambda c: c["check"])  # noqa: E731
    assert by_name(merged["evaluation"]) == by_name(report["evaluation"])
    assert merged["evaluation"]["gaps"] == report["evaluation"]["gaps"] and not merged["evaluation"]["pending"]
    assert (merged_dir / "train_parity.png").stat().st_size > 0


def test_merge_refuses_other_configurations_and_conflicting_runs(tp1_run, tmp_path, capsys):
    out, report, _ = tp1_run
    other = json.loads(json.dumps(report))
    other["configuration"]["seed"] += 1
    train_parity_report.write(other, tmp_path / "other_seed")
    with pytest.raises(SystemExit):
        train_parity.main(["--merge", str(out), str(tmp_path / "other_seed"), "--out", str(tmp_path / "m1")])
    assert "has seed=1235" in capsys.readouterr().err
    changed = json.loads(json.dumps(report))
    changed["runs"]["legacy/offload-off"][-1]["loss"] += 1e-9
    train_parity_report.write(changed, tmp_path / "changed")
    with pytest.raises(SystemExit):
        train_parity.main(["--merge", str(out), str(tmp_path / "changed"), "--out", str(tmp_path / "m2")])
    assert f"run legacy/offload-off of {tmp_path / 'changed'} differs from an earlier report's at steps [{STEPS}]" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        train_parity.main(["--merge", str(out), "--modes", "legacy", "--out", str(tmp_path / "m3")])
    assert "--merge reads finished reports; --modes apply to training runs only" in capsys.readouterr().err


def test_on_policy_check_reads_every_micro_batchs_ppo_kl(tp1_run):
    """Every step records each update micro-batch's actor/ppo_kl and actor/pg_clipfrac, and the largest difference of
    a token's log-prob between the two packings. Under megatron's batch_invariant_mode (TE with FlashAttention 3/4:
    GPU only) with the old log-probs in another packing, the report requires all of them to be exactly 0; here the
    CPU run's rows are relabelled as such a run (the configuration's two fields) to exercise the check; without
    batch invariance it is not made."""
    _, report, _ = tp1_run
    runs = json.loads(json.dumps(report["runs"]))
    assert report["configuration"]["old_log_prob_micro_batch"] == 2
    assert not any("on-policy" in c["check"] for c in report["evaluation"]["checks"])
    for rows in runs.values():
        for row in rows:
            assert len(row["ppo_kl"]) == len(row["pg_clipfrac"]) == 2, row  # 10 sequences in micro-batches of 5
            assert all(abs(v) < 1e-3 for v in row["ppo_kl"]), row  # the same weights: at most packing's rounding
            assert 0.0 <= row["packing_max_abs"] < 1e-4, row  # a token's log-prob in both packings, fp32
            row["ppo_kl"], row["pg_clipfrac"], row["packing_max_abs"] = [0.0, 0.0], [0.0, 0.0], 0.0
    invariant = report["configuration"] | {"batch_invariant": True}
    checks = [c for c in train_parity_report.evaluate(runs, invariant)["checks"] if "on-policy" in c["check"]]
    assert len(checks) == len(runs) and all(c["ok"] for c in checks), checks
    assert "old log-probs in micro-batches of 2, the update in 5" in checks[0]["check"]
    runs["hook-auto/offload-off"][2]["ppo_kl"][1] = 1e-12
    runs["legacy/resumed"][0]["pg_clipfrac"][0] = 0.1
    runs["legacy/offload-off"][1]["packing_max_abs"] = 6e-8  # one token one ulp off, the ratios still 1
    failed = {
        c["check"].split(":")[0]: c["differing_steps"]
        for c in train_parity_report.evaluate(runs, invariant)["checks"]
        if "on-policy" in c["check"] and not c["ok"]
    }
    assert failed == {"hook-auto/offload-off": [3], "legacy/resumed": [3], "legacy/offload-off": [2]}


def test_gap_checks_and_sentences_follow_the_numbers(tp1_run):
    """A mode whose numbers drift from legacy's: the gap per step, the bound, and the sentence explaining it."""
    _, report, _ = tp1_run
    runs = json.loads(json.dumps(report["runs"]))
    mask = runs["hook-auto-mask/offload-off"]
    mask[1]["loss"] += 5e-5  # step 2: within fp32's 1e-4 loss bound
    mask[2]["grad_norm"] *= 1 + 2e-3  # step 3: beyond fp32's 1e-3 grad-norm bound
    evaluation = train_parity_report.evaluate(runs, report["configuration"], report["run_info"])
    gap = evaluation["gaps"]["hook-auto-mask vs legacy"]
    assert [round(r["loss_abs"], 12) for r in gap["per_step"]] == [0, round(5e-5, 12), 0, 0]
    assert gap["grad_norm_rel"] == pytest.approx(2e-3, rel=1e-6)
    failed = {c["check"]: c.get("differing_steps") for c in evaluation["checks"] if not c["ok"]}
    assert failed == {  # the changed run no longer matches its own offload and resumed runs either
        "hook-auto-mask: offload on == off": [2, 3],
        "hook-auto-mask: resumed == uninterrupted (steps 3-4)": [3],
        "hook-auto-mask vs legacy: loss within 0.0001 (absolute), grad norm within 0.001 (relative)": None,
    }
    sentence = train_parity_report.explanation("hook-auto-mask vs legacy", gap, "cpu", "float32")
    assert "its loss gap (0.0e+00)" in sentence and "reaches 5.0e-05 at step 2" in sentence and "2.0e-03" in sentence


def test_a_killed_command_leaves_its_finished_runs_on_disk(tmp_path):
    """Stopped by a time limit after its first run: that run, evaluated as far as it goes, is in the report."""
    command = [*COMMAND, "--device", "cpu", "--steps", str(STEPS), "--out", str(tmp_path / "out"),
               "--modes", "legacy,hook-auto", "--offload", "off"]  # fmt: skip
    checkpoints = tmp_path / "checkpoints"  # the killed command cannot remove its checkpoint: keep it in tmp_path
    checkpoints.mkdir()
    env = {**ENV, "TRAIN_PARITY_CHECKPOINT_DIR": str(checkpoints)}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, start_new_session=True)  # fmt: skip
    try:
        for line in process.stdout:
            if line.startswith("[legacy/offload-off] "):
                break
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the command and the worker processes it spawned
        process.wait(timeout=60)
    report = json.loads((tmp_path / "out" / "train_parity.json").read_text())
    assert list(report["runs"]) == ["legacy/offload-off"]
    assert_trains(report["runs"]["legacy/offload-off"])
    assert report["evaluation"]["pending"] == ["legacy/resumed (for legacy: resumed == uninterrupted)"]
    assert "legacy/resumed" in (tmp_path / "out" / "train_parity.md").read_text()


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
        (["--old-log-prob-micro-batch", "4"], "--old-log-prob-micro-batch 4: must be >= 1 and divide prompts*n = 10"),
        (["--prompt-lengths", "5"], "--prompt-lengths: expected LO,HI"),
        (["--response-lengths", "4,2"], "RolloutShape.response_lengths: expected 1 <= low <= high"),
    ],
)
def test_bad_arguments_name_the_field(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        train_parity.parse_plan(["--device", "cpu", *args], str(tmp_path))
    assert message in capsys.readouterr().err
