"""verl's policy losses inside the op, through verl's real `MegatronEngine.forward_backward_batch` (issue 23).

Each case runs one actor micro-batch loop (two micro-batches of four GRPO sequences of very different
lengths, mixed per-sample temperatures) on verl's real engine, built by verl (`support/train_engine.py`), in
hook mode three ways on the same weights and batch:

- reference: the op's two-pass log-probs and entropy, then verl's own `ppo_loss` / `sft_loss` (fused loss off);
- fused: `output_processor_fused_loss=true`, the loss inside the op (score mask on, the default);
- fused, every row: the same with `output_processor_score_mask=false`.

Asserted (fp32, 1e-5 relative): every micro-batch's loss, every metric verl returns, every parameter gradient
on every rank, and that the fused engine really computed the loss inside the op (the plugin's HookCounts).
TP=2 runs over two gloo processes. Sequence-level losses (gspo, geo_mean) run with chunks small enough that a
micro-batch spans several, kept whole per sequence; a sequence longer than a chunk takes the two-pass path
with its log line, and clip_cov / kl_cov stay on verl's two-pass path with theirs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from functools import partial

import pytest
import torch

from verl_fused_hook_harness.support.distributed import run_in_processes

SEED = 1234
RTOL = 1e-5
SHAPE = dict(prompts=4, n=2, prompt_lengths=(3, 9), response_lengths=(2, 20))  # 8 sequences, 2 micro-batches
TEMPERATURES = (0.7, 1.0, 0.5, 1.3, 0.9, 1.0, 0.6, 1.1)
# ~30 portable fp32 logit rows of the tiny config's 1000 columns (at TP=2: ~60 of 500): a micro-batch's ~45
# response rows take two or more chunks, no sequence (<= 20 rows) is longer than one.
SMALL_CHUNK_GIB = 30 * 4 * 1000 / 1024**3
TINY_CHUNK_GIB = 6 * 4 * 1000 / 1024**3  # a chunk shorter than the longer sequences: the two-pass fallback

POLICY = {
    # name: (loss_mode, ActorConfig overrides, PolicyLossConfig overrides)
    "vanilla": (
        "vanilla",
        dict(clip_ratio_low=0.1, clip_ratio_high=0.28, use_kl_loss=True, kl_loss_type="low_var_kl"),
        {},
    ),
    "dppo_tv": ("dppo_tv", dict(clip_ratio=0.05), {}),
    "dppo_kl": ("dppo_kl", dict(clip_ratio=0.02, loss_agg_mode="seq-mean-token-sum"), {}),
    "sapo": ("sapo", dict(loss_agg_mode="seq-mean-token-mean"), {}),
    "gpg": ("gpg", dict(loss_agg_mode="token-sum", use_kl_loss=True, kl_loss_type="k3"), {}),
    "dro": ("dro", dict(), dict(dro_beta=0.3)),
    "cispo": ("cispo", dict(clip_ratio_high=0.2, loss_agg_mode="seq-mean-token-sum-norm"), {}),
    "bypass_mode": ("bypass_mode", dict(), {}),  # rollout_correction's default: sequence-level IS, ppo_clip
    "gspo": ("gspo", dict(loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4), {}),
    "geo_mean": ("geo_mean", dict(clip_ratio=0.1), {}),
}
TWO_PASS_ONLY = ("clip_cov", "kl_cov")


def actor_config(name: str):
    from verl.workers.config.actor import McoreActorConfig

    mode, overrides, policy = POLICY.get(name, (name, {}, {}))
    config = McoreActorConfig(
        ppo_mini_batch_size=SHAPE["prompts"], ppo_micro_batch_size_per_gpu=4, use_dynamic_bsz=False,
        entropy_coeff=0.01, kl_loss_coef=0.1, rollout_n=SHAPE["n"], **overrides,
    )  # fmt: skip
    return dataclasses.replace(config, policy_loss=dataclasses.replace(config.policy_loss, loss_mode=mode, **policy))


def loss_function(name: str):
    from verl.workers.utils.losses import ppo_loss, sft_loss

    return partial(sft_loss, config=None) if name == "sft" else partial(ppo_loss, config=actor_config(name))


def batch(engine, sft: bool):
    """The micro-batches of one actor update, as the trainer hands them to the engine."""
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_fused_hook_harness.support.grpo_batches import RolloutShape, packed, rollout

    shape = RolloutShape(**SHAPE)
    fields = rollout(shape, engine.model_config.hf_config.vocab_size, SEED, 1)
    generator = torch.Generator().manual_seed(SEED)
    keys = dict(use_remove_padding=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=4, use_fused_kernels=True)
    forward = packed(fields, 1.0, calculate_entropy=False, compute_loss=False, **keys)
    with engine.eval_mode():
        current = no_padding_2_padding(engine.infer_batch(forward)["model_output"]["log_probs"], forward).float().cpu()
    fields["old_log_probs"] = current + 0.15 * torch.randn(current.shape, generator=generator)
    fields["ref_log_prob"] = current + 0.1 * torch.randn(current.shape, generator=generator)
    data = packed(fields, 1.0, calculate_entropy=not sft, global_batch_size=shape.sequences, **keys)
    data["temperature"] = torch.tensor(TEMPERATURES)
    if sft:  # sft_loss reads a jagged loss mask over prompt and response, the prompt masked
        prompt_lengths = fields["attention_mask"][:, : fields["prompts"].shape[1]].sum(dim=1)
        response_lengths = fields["response_mask"].sum(dim=1)
        data["loss_mask"] = torch.nested.as_nested_tensor(
            [
                torch.cat([torch.zeros(int(p)), torch.ones(int(r))]).long()
                for p, r in zip(prompt_lengths, response_lengths)
            ],
            layout=torch.jagged,
        )
    return data


def _update(engine, name: str) -> dict:
    from verl_fused_hook.verl_integration.model_plan import counts_of

    engine.optimizer_zero_grad()
    fused_before = sum(counts_of(m).fused_loss_forwards for m in engine.module)
    with engine.train_mode():  # which zeroes the gradients on exit: read them inside
        output = engine.forward_backward_batch(batch(engine, name == "sft"), loss_function(name), forward_only=False)
        grads = {
            n: p.main_grad.detach().clone() for m in engine.module for n, p in m.named_parameters() if p.requires_grad
        }
    assert any(float(grad.abs().max()) > 0 for grad in grads.values())
    return {
        "losses": [float(x) for x in output["loss"]],
        "metrics": {key: _metric(value) for key, value in output["metrics"].items()},
        "grads": grads,
        "fused_forwards": sum(counts_of(m).fused_loss_forwards for m in engine.module) - fused_before,
    }


def _metric(value) -> list[float]:
    """A metric's numbers: a verl Metric's values (one per micro-batch), or a list of plain values."""
    values = getattr(value, "values", value)
    return [float(v) for v in (values if isinstance(values, (list, tuple)) else [values])]


def worker(rank: int, world_size: int, names: tuple[str, ...], chunk_gib: float | None) -> dict:
    from verl_fused_hook.verl_integration import install
    from verl_fused_hook_harness.stand_ins.cuda_on_cpu import cuda_names_on_cpu
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel
    from verl_fused_hook_harness.support.hf_model import TINY_QWEN2
    from verl_fused_hook_harness.support.train_engine import EngineSetup, build_engine

    os.environ["VERL_FUSED_USE_OP_HOOK"] = "1"
    install()
    log = _LogLines()
    logging.getLogger("verl_fused_hook").addHandler(log)
    logging.getLogger("verl_fused_hook.ops.chunking").setLevel(logging.DEBUG)  # how each call chunked its rows
    init_model_parallel(world_size, seed=SEED)
    chunk = {} if chunk_gib is None else {"output_processor_fused_loss_chunk_gib": chunk_gib}
    variants = {
        "reference": {},
        "fused": {"output_processor_fused_loss": True, **chunk},
        "fused_every_row": {"output_processor_fused_loss": True, "output_processor_score_mask": False, **chunk},
    }
    results = {}
    with cuda_names_on_cpu():  # stand-in: megatron's schedules and verl's engine name CUDA tensors
        for variant, options in variants.items():
            setup = EngineSetup(hf_path=str(TINY_QWEN2), tp=world_size, dtype="float32", seed=SEED, micro_batch_size=4,
                                total_steps=1, lr=1e-4, offload=False,
                                fused_kernel_options={"output_processor_backend": "torch", **options})  # fmt: skip
            engine = build_engine(setup)
            for name in names:
                results[name, variant] = _update(engine, name)
    results["log"] = log.lines
    return results


class _LogLines(logging.Handler):
    """The plugin's log lines in a worker, handed back to the test (caplog sees only the test's process)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def assert_matches(results: dict, names, rank: int, expect_fused: bool = True) -> None:
    for name in names:
        want = results[name, "reference"]
        assert want["fused_forwards"] == 0
        for variant in ("fused", "fused_every_row"):
            got, where = results[name, variant], f"{name} {variant} rank {rank}"
            assert got["fused_forwards"] == (2 if expect_fused else 0), where  # both micro-batches, loss inside
            assert got["losses"] == pytest.approx(want["losses"], rel=RTOL, abs=1e-7), where
            assert got["metrics"].keys() == want["metrics"].keys(), where
            for key, value in want["metrics"].items():
                assert got["metrics"][key] == pytest.approx(value, rel=RTOL, abs=1e-7), f"{where}: {key}"
            assert len(want["losses"]) == 2 and (name == "sft" or len(want["metrics"]) >= 2), (
                where
            )  # sft_loss: no metrics
            assert got["grads"].keys() == want["grads"].keys()
            for param, grad in want["grads"].items():
                scale = float(grad.abs().max())
                error = float((got["grads"][param] - grad).abs().max())
                assert error <= RTOL * max(scale, 1e-6), f"{where}: {param} differs by {error:.3e} (scale {scale:.3e})"


TOKEN_LEVEL = ("vanilla", "dppo_tv", "dppo_kl", "sapo", "gpg", "dro", "cispo", "sft")


def test_token_level_losses_inside_the_op_equal_verls_loss_tp1():
    (results,) = run_in_processes(worker, 1, TOKEN_LEVEL, None)
    assert_matches(results, TOKEN_LEVEL, 0)


def chunk_counts(log: list[str], loss_mode: str) -> list[int]:
    """How many chunks each fused call of `loss_mode` took (the op's debug line)."""
    pattern = re.compile(rf"loss ppo_loss\(loss_mode={loss_mode}, .*: \d+ scored rows in (\d+) chunks")
    return [int(match.group(1)) for line in log if (match := pattern.search(line))]


def test_sequence_level_losses_in_chunks_of_whole_sequences_tp1():
    names = ("gspo", "geo_mean", "bypass_mode")
    (results,) = run_in_processes(worker, 1, names, SMALL_CHUNK_GIB)
    assert_matches(results, names, 0)
    for mode in names:  # every micro-batch of both fused variants spans several chunks, none falls back
        counts = chunk_counts(results["log"], mode)
        assert len(counts) == 4 and min(counts) >= 2, (mode, counts)
    assert not any("more than a chunk holds" in line for line in results["log"])


def test_losses_inside_the_op_under_tp2():
    names = ("vanilla", "gspo", "sft")
    for rank, results in enumerate(run_in_processes(worker, 2, names, SMALL_CHUNK_GIB)):
        assert_matches(results, names, rank)
        assert min(chunk_counts(results["log"], "gspo")) >= 2, results["log"]


def test_a_sequence_longer_than_a_chunk_and_non_separable_losses_take_the_two_pass_path():
    (results,) = run_in_processes(worker, 1, ("gspo", "clip_cov", "kl_cov"), TINY_CHUNK_GIB)
    assert_matches(results, ("gspo",), 0)  # the loss computed inside the op's own two-pass path: still exact
    assert_matches(results, TWO_PASS_ONLY, 0, expect_fused=False)
    log = results["log"]
    assert any(
        "loss ppo_loss(loss_mode=gspo, loss_agg_mode=seq-mean-token-mean): row group" in line
        and "more than a chunk holds" in line
        and "this call runs the two-pass path" in line
        for line in log
    ), log
    for mode in TWO_PASS_ONLY:
        assert any(
            f"output_processor_fused_loss: policy_loss.loss_mode={mode} (" in line
            and line.endswith("is not separable; two-pass path")
            for line in log
        ), (mode, log)
