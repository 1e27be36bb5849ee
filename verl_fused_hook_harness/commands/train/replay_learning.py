"""replay-learning: a model learning through sampling replay. A GRPO run whose rollouts the model samples itself under
top-k / top-p (vLLM's rule), through verl's Megatron engine, in three arms on the same initial weights and prompts:

- `legacy`: verl's monkey-patched fused forward (VERL_FUSED_USE_OP_HOOK=0), log-probs over the whole vocabulary;
- `hook`: hook mode, the plugin's defaults, whole vocabulary;
- `hook+replay`: hook mode with `output_processor_sampling_replay=true`, the rollout's kept sets in the batch
  (`rollout_kept_ids`, what vLLM's mask replay returns): log-probs renormalized over them.

Why bypass mode: verl 0.9.1's `algorithm.rollout_correction.bypass_mode` takes the rollout's log-probs as pi_old, so
the PPO ratio is the trainer's log-prob over vLLM's processed (renormalized) one: the truncation's kept mass enters
the ratio and the clip fraction without replay, and cancels with it. The update here does the same (old_log_probs =
the rollout's). Before each update a forward-only pass gives the trainer's pi_old, from which the mean ratio
pi_old / pi_rollout is read (the ratio the loss starts from).

The task, learnable from scratch by a tiny model: prompts of `alphabet` tokens (ids 3..); each response token scores
1 when it is the successor (cyclic in the alphabet) of the alphabet token before it, 0.25 when it is another alphabet
token, else 0; a response's reward is the mean over its tokens (on its last token, GRPO advantages by verl's
`compute_grpo_outcome_advantage`). Per step and arm: mean reward, the policy's full-vocabulary entropy at the
sampled positions, the kept mass, the mean ratio pi_old / pi_rollout and the fraction of tokens outside
[0.9, 1.1], verl's pg_clipfrac and ppo_kl. Writes replay_learning.json and replay_learning.png under --out, and each
arm's steps to steps_ARM.jsonl there as they finish.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from verl_fused_hook.switch import ENV_VAR

from ...support.distributed import backend_for, run_in_processes
from ...support.grpo_batches import packed
from ...support.hf_model import TINY_QWEN2
from ...support.modes import Mode
from ...support.reports import device_name, pyplot, write_json
from ...support.truncated_sampling import Truncation, sample_responses
from .runs import metric_values, mode_context

logger = logging.getLogger(__name__)

FIRST_ALPHABET_ID = 3  # after padding (support/grpo_batches.PAD_TOKEN_ID = 0), bos (1) and eos (2)
ARMS = {
    "legacy": (Mode("legacy", hook=False, kernel="verl"), {}),
    "hook": (Mode("hook", hook=True, kernel="ours", score_mask=True), {}),
    "hook+replay": (
        Mode("hook+replay", hook=True, kernel="ours", score_mask=True, replay="given"),
        {"output_processor_sampling_replay": True},
    ),
}
RATIO_BAND = (0.9, 1.1)


@dataclass(frozen=True)
class LearningPlan:
    """Everything the worker process needs (picklable)."""

    hf_path: str
    device: str
    dtype: str
    tp: int  # tensor-parallel size (CPU: gloo processes; CUDA: one GPU a rank)
    steps: int
    prompts: int  # per step
    n: int  # responses per prompt
    prompt_length: int
    response_length: int
    alphabet: int
    truncation: Truncation
    lr: float
    micro_batch: int
    seed: int
    arms: tuple[str, ...]
    parallel_arms: bool = False  # every arm in a process of its own at once (one GPU: the tiny model leaves it idle)
    out: str = ""  # the report's folder: each arm's steps are appended to steps_ARM.jsonl as they finish


def task_rewards(prompts: torch.Tensor, responses: torch.Tensor, alphabet: int) -> torch.Tensor:
    """[B] float: the mean over each response's tokens of 1 (the successor, cyclic, of the alphabet token before it),
    0.25 (another alphabet token) or 0."""
    chain = torch.cat([prompts[:, -1:], responses], dim=1) - FIRST_ALPHABET_ID
    is_letter = (chain >= 0) & (chain < alphabet)
    before, letters, after_letter, in_alphabet = chain[:, :-1], chain[:, 1:], is_letter[:, :-1], is_letter[:, 1:]
    # a token after one outside the alphabet has no successor to be (else cycles through other tokens would score)
    successor = in_alphabet & after_letter & (letters == (before + 1) % alphabet)
    return torch.where(successor, 1.0, torch.where(in_alphabet, 0.25, 0.0)).mean(dim=1)


def _rollout(gpt, plan: LearningPlan, step: int) -> dict:
    """One step's rollout in verl's padded layout (fixed lengths: no padding), with GRPO advantages, the rollout's
    log-probs and kept sets, and what the step reports about the policy."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    device = torch.device(plan.device)
    generator = torch.Generator(device=device).manual_seed(plan.seed * 1_000_003 + step)
    groups = torch.randint(0, plan.alphabet, (plan.prompts, plan.prompt_length), generator=generator, device=device)
    prompts = (groups + FIRST_ALPHABET_ID).repeat_interleave(plan.n, dim=0)
    drawn = sample_responses(gpt, prompts, plan.response_length, plan.truncation, generator)
    rewards = task_rewards(prompts, drawn.responses, plan.alphabet).cpu()
    sequences = prompts.shape[0]
    response_mask = torch.ones(sequences, plan.response_length, dtype=torch.long)
    token_rewards = torch.zeros(sequences, plan.response_length)
    token_rewards[:, -1] = rewards
    uid = np.array([f"prompt{i // plan.n}" for i in range(sequences)], dtype=object)
    advantages, _ = compute_grpo_outcome_advantage(token_rewards, response_mask.float(), uid)
    input_ids = torch.cat([prompts, drawn.responses], dim=1).cpu()
    attention_mask = torch.ones_like(input_ids)
    fields = {
        "prompts": prompts.cpu(),
        "responses": drawn.responses.cpu(),
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": attention_mask.cumsum(dim=1) - 1,
        "response_mask": response_mask,
        "advantages": advantages,
        "rollout_log_probs": drawn.log_probs.cpu(),
    }
    observed = {
        "reward": float(rewards.mean()),
        "entropy": float(drawn.entropy.mean()),
        "kept_mass": float(drawn.kept_mass.mean()),
        "kept_size": float((drawn.kept_ids >= 0).sum(dim=2).float().mean()),
    }
    return fields, drawn.kept_ids.cpu(), observed


def _ppo_loss(plan: LearningPlan):
    """verl's ppo_loss for a GRPO update: clipped policy loss (clip 0.2), token-mean, no entropy or KL term."""
    import functools

    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    config = McoreActorConfig(
        ppo_mini_batch_size=plan.prompts,
        ppo_micro_batch_size_per_gpu=plan.micro_batch,
        use_dynamic_bsz=False,
        entropy_coeff=0.0,
        use_kl_loss=False,
        loss_agg_mode="token-mean",
        rollout_n=plan.n,
    )
    return functools.partial(ppo_loss, config=config)


def _engine_keys(plan: LearningPlan) -> dict:
    return dict(use_remove_padding=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=plan.micro_batch,
                use_fused_kernels=True)  # fmt: skip


def _step(actor, gpt, plan: LearningPlan, replay: bool, loss_function, step: int) -> dict:
    from verl.workers.utils.padding import no_padding_2_padding

    started = time.perf_counter()
    fields, kept_ids, row = _rollout(gpt, plan, step)
    if replay:
        fields["rollout_kept_ids"] = kept_ids
    temperature = plan.truncation.temperature
    data = packed(fields, temperature, calculate_entropy=False, compute_loss=False, **_engine_keys(plan))
    with actor.eval_mode():
        old = actor.infer_batch(data, loss_function=None)
    old_log_probs = no_padding_2_padding(old["model_output"]["log_probs"], data).float().cpu()
    ratio = (old_log_probs - fields["rollout_log_probs"]).exp()
    update = dict(fields, old_log_probs=fields["rollout_log_probs"])  # bypass mode: pi_old is the rollout's
    data = packed(update, temperature, calculate_entropy=False, global_batch_size=plan.prompts * plan.n,
                  **_engine_keys(plan))  # fmt: skip
    with actor.train_mode():
        output = actor.train_batch(data, loss_function=loss_function)
    actor.lr_scheduler_step()
    metrics = output.get("metrics", {})
    clipfrac, ppo_kl = metric_values(metrics.get("actor/pg_clipfrac")), metric_values(metrics.get("actor/ppo_kl"))
    low, high = RATIO_BAND
    return row | {
        "step": step,
        "ratio_mean": float(ratio.mean()),
        "ratio_outside_band": float(((ratio < low) | (ratio > high)).float().mean()),
        "pg_clipfrac": sum(clipfrac) / len(clipfrac),
        "ppo_kl": sum(ppo_kl) / len(ppo_kl),
        "seconds": time.perf_counter() - started,
    }


def _arm_worker(rank: int, world_size: int, plan: LearningPlan) -> dict:
    """Every arm of `plan` in turn in this process: its engine from the same seed, `steps` GRPO steps; the rows per
    arm."""
    from verl_fused_hook.probe import unwrap_to_gpt
    from verl_fused_hook.verl_integration.sampling_replay import RolloutSampling, rollout_sampling

    from ...support.train_engine import EngineSetup, build_engine, release_engines
    from ...support.verl_engine import prepare_verl_process

    prepare_verl_process(rank)
    if plan.device == "cpu":
        from ...stand_ins.megatron_cpu import init_model_parallel

        init_model_parallel(plan.tp, seed=plan.seed)
    sampling = RolloutSampling(top_k=plan.truncation.top_k, top_p=plan.truncation.top_p)
    results = {}
    for name in plan.arms:
        mode, options = ARMS[name]
        os.environ[ENV_VAR] = "1" if mode.hook else "0"
        setup = EngineSetup(
            hf_path=plan.hf_path, tp=plan.tp, dtype=plan.dtype, seed=plan.seed, micro_batch_size=plan.micro_batch,
            total_steps=plan.steps, lr=plan.lr, offload=False, fused_kernel_options=options,
        )  # fmt: skip
        with mode_context(mode, plan.device), rollout_sampling(sampling):
            actor = build_engine(setup)
            gpt = unwrap_to_gpt(actor.module[0])
            loss_function = _ppo_loss(plan)
            rows = []
            steps_file = Path(plan.out) / f"steps_{name.replace('+', '_')}.jsonl"  # names a device hands back
            if rank == 0:
                steps_file.unlink(missing_ok=True)
            for step in range(1, plan.steps + 1):
                rows.append(_step(actor, gpt, plan, mode.replay is not None, loss_function, step))
                if rank != 0:  # every rank draws the same rollout and reads the same metrics
                    continue
                with steps_file.open("a") as lines:  # a run cut short keeps the steps it made
                    lines.write(json.dumps(rows[-1]) + "\n")
                if step == 1 or step % 10 == 0 or step == plan.steps:
                    last = rows[-1]
                    print(f"[{name}] step {step}: reward {last['reward']:.3f} ratio {last['ratio_mean']:.4f} "
                          f"clipfrac {last['pg_clipfrac']:.3f} entropy {last['entropy']:.3f} "
                          f"({last['seconds']:.2f}s)", flush=True)  # fmt: skip
        release_engines(actor)
        results[name] = rows
    return results


def summary(runs: dict[str, list[dict]], window: int) -> dict[str, dict]:
    """Per arm: the first and last `window` steps' mean reward, and the mean ratio and clip fraction over the run."""

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    return {
        name: {
            "reward_first": mean(rows[:window], "reward"),
            "reward_last": mean(rows[-window:], "reward"),
            "ratio_mean": mean(rows, "ratio_mean"),
            "ratio_min": min(r["ratio_mean"] for r in rows),
            "ratio_max": max(r["ratio_mean"] for r in rows),
            "pg_clipfrac": mean(rows, "pg_clipfrac"),
            "entropy_last": mean(rows[-window:], "entropy"),
        }
        for name, rows in runs.items()
    }


def plot(report: dict, path: Path) -> bool:
    """Reward, entropy, mean ratio and clip fraction per step, one line per arm; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        logger.warning("replay-learning: matplotlib is not installed, no %s", path.name)
        return False
    panels = (
        ("reward", "mean reward"),
        ("entropy", "entropy (full vocabulary)"),
        ("ratio_mean", "mean ratio pi_old / pi_rollout"),
        ("pg_clipfrac", "clip fraction (pg_clipfrac)"),
    )
    figure, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    for axis, (key, label) in zip(axes, panels):
        for name, rows in report["runs"].items():
            dashed = {"linestyle": (0, (4, 3)), "linewidth": 2} if name == "legacy" else {"linewidth": 1}
            axis.plot([r["step"] for r in rows], [r[key] for r in rows], label=name, **dashed)  # legacy under hook
        axis.set(xlabel="GRPO step", ylabel=label)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    t = report["configuration"]["truncation"]
    figure.suptitle(
        f"GRPO, rollouts sampled with top_k={t['top_k']}, top_p={t['top_p']}, T={t['temperature']} "
        f"(bypass mode) on {report['device']}",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--hf-config", default=str(TINY_QWEN2), help="a Hugging Face config folder (random weights)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (CPU: gloo processes; CUDA: GPUs)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt (GRPO group)")
    parser.add_argument("--prompt-length", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=8)
    parser.add_argument("--alphabet", type=int, default=8, help="the task's tokens: ids 3..3+alphabet-1")
    parser.add_argument("--top-k", type=int, default=50, help="the rollout's top_k (-1: off)")
    parser.add_argument("--top-p", type=float, default=0.9, help="the rollout's top_p, in (0, 1)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--micro-batch", type=int, default=32, help="sequences per micro-batch")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, else fp32")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    parser.add_argument(
        "--parallel-arms",
        action="store_true",
        help="each arm in a process of its own, at once (a GPU the tiny model "
        "leaves mostly idle; on the CPU they share the cores)",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for replay_learning.json and .png")
    return parser


def plan_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> LearningPlan:
    arms = tuple(a for a in args.arms.split(",") if a)
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        parser.error(f"--arms: unknown {unknown or 'empty'}; allowed: {', '.join(ARMS)}")
    if not 0 < args.top_p < 1 and args.top_k <= 0:
        parser.error(f"--top-p {args.top_p} and --top-k {args.top_k}: replay needs a truncation (top_p < 1 or top_k)")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p: expected a value in (0, 1], got {args.top_p}")
    for name in ("tp", "steps", "prompts", "n", "prompt_length", "response_length", "micro_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected >= 1, got {getattr(args, name)}")
    if args.n < 2:
        parser.error(f"--n: GRPO's advantages need >= 2 responses per prompt, got {args.n}")
    if args.prompts * args.n % args.micro_batch:
        parser.error(f"--micro-batch: verl's update splits the {args.prompts * args.n} sequences (--prompts x --n) "
                     f"into micro-batches of equal size; {args.micro_batch} does not divide them")  # fmt: skip
    vocab = json.loads((Path(args.hf_config) / "config.json").read_text())["vocab_size"]
    if not 2 <= args.alphabet <= vocab - FIRST_ALPHABET_ID:
        parser.error(f"--alphabet: expected 2..{vocab - FIRST_ALPHABET_ID} (the model's vocabulary {vocab} less "
                     f"ids 0-2), got {args.alphabet}")  # fmt: skip
    if args.device == "cuda" and torch.cuda.device_count() < args.tp:
        parser.error(f"--device cuda --tp {args.tp}: needs {args.tp} CUDA devices, found {torch.cuda.device_count()}")
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return LearningPlan(
        hf_path=args.hf_config, device=args.device, dtype={"bf16": "bfloat16", "fp32": "float32"}[dtype], tp=args.tp,
        steps=args.steps, prompts=args.prompts, n=args.n, prompt_length=args.prompt_length,
        response_length=args.response_length, alphabet=args.alphabet,
        truncation=Truncation(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p),
        lr=args.lr, micro_batch=args.micro_batch, seed=args.seed, arms=arms, parallel_arms=args.parallel_arms,
        out=str(args.out),
    )  # fmt: skip


def run(plan: LearningPlan) -> dict:
    """Each arm in a fresh process of its own (one after the other, or all at once with `parallel_arms`); the report
    written to `plan.out` (JSON and PNG) and returned. An arm that fails is named under "failed" with its error; the
    others' steps are kept."""

    def one_arm(arm: str) -> tuple[str, list[dict] | str]:
        try:
            single = replace(plan, arms=(arm,))
            return arm, run_in_processes(_arm_worker, plan.tp, single, backend=backend_for(plan.device))[0][arm]
        except RuntimeError as error:  # the worker's traceback, raised in this process
            return arm, str(error)

    out = Path(plan.out)
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(len(plan.arms) if plan.parallel_arms else 1) as pool:
        finished = dict(pool.map(one_arm, plan.arms))
    runs = {arm: rows for arm, rows in finished.items() if not isinstance(rows, str)}
    report = {
        "device": device_name(plan.device),
        "configuration": asdict(plan),
        "runs": runs,
        "failed": {arm: error for arm, error in finished.items() if isinstance(error, str)},
        "summary": summary(runs, window=max(1, min(10, plan.steps // 4))),
    }
    write_json(report, out / "replay_learning.json")
    plot(report, out / "replay_learning.png")
    return report


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    plan = plan_from_args(parser, args)
    report = run(plan)
    for name, error in report["failed"].items():
        print(f"{name}: FAILED\n{error}")
    for name, values in report["summary"].items():
        print(f"{name}: reward {values['reward_first']:.3f} -> {values['reward_last']:.3f}, mean ratio "
              f"{values['ratio_mean']:.4f} [{values['ratio_min']:.4f}, {values['ratio_max']:.4f}], clip fraction "
              f"{values['pg_clipfrac']:.3f} ({report['device']})")  # fmt: skip
    return 1 if report["failed"] else 0
