"""MTP under context parallelism (CP=2, and CP=2 x TP=2): hook mode's fused MTP loss against megatron's unfused one.

Each CP rank holds two zigzag halves of every packed (THD) sequence, so megatron's
`roll_tensor` moves labels and loss masks across CP ranks (`_roll_tensor_packed_seq`)
once per MTP layer, and the MTP block rolls its inputs the same way. Both sides run
through verl's real engine (build step with `mtp.enable=True, enable_train=True`,
`patch_engine_mtp`, `forward_step`, which packs with CP padding and zigzag split) on
real megatron-core GPTModels; the CPU core attention for THD under CP is
testing/cp_attention.py's. verl as it ships calls megatron's `process_mtp_loss` (MTP
logits through the output layer); hook mode calls `fused_process_mtp_loss`. Per rank:
log-probs, every parameter gradient and the logged MTP metrics (loss, acceptance
counts) within 1e-5 relative. Across ranks, against a CP=1 run of the same model and
batch: log-probs equal, and the acceptance counts and the MTP loss sum (loss x
tokens) summed over CP ranks equal CP=1's, so the rolls cover exactly the tokens an
unsplit sequence scores.
"""

import pytest
import torch

from verl_fused_hook_harness.support.distributed import run_in_processes

VOCAB = 160
RTOL = 1e-5
# prompt + response lengths 9, 8, 10: with CP=2 (x TP=2) every sequence is padded to a multiple of 4 (8),
# and every sequence's zigzag halves cross the CP ranks.
PROMPT_LENS, RESPONSE_LENS = (4, 3, 3), (5, 5, 7)

CASES = {
    # name: (tp, sequence_parallel, tied, mtp layers, calculate_per_token_loss)
    "cp2_untied_mtp1": (1, False, False, 1, False),
    "cp2_tied_mtp2_per_token": (1, False, True, 2, True),
    "cp2_tp2_sp_untied_mtp2": (2, True, False, 2, False),
}


def rl_batch(per_token: bool):
    from verl.utils import tensordict_utils as tu

    from verl_fused_hook_harness.support.micro_batches import forward_step_batch as mtp_batch

    def nested(parts):
        return torch.nested.as_nested_tensor(list(parts), layout=torch.jagged)

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator) for n in PROMPT_LENS]
    responses = [torch.randint(0, VOCAB, (n,), generator=generator) for n in RESPONSE_LENS]
    batch = mtp_batch(
        nested(torch.cat(pair) for pair in zip(prompts, responses)), nested(prompts), nested(responses), 0.7
    )
    batch["loss_mask"].values()[6] = 0  # a tool-output token inside the first response
    if per_token:  # what verl's engine assigns before forward_step (routed / batch tokens = 0.8)
        tu.assign_non_tensor(batch, batch_num_tokens=20, routed_num_tokens=16)
    return batch


def run_case(name: str) -> dict:
    from verl_fused_hook.verl_integration.forward_step import response_score_rows
    from verl_fused_hook_harness.stand_ins.megatron_cpu import build_cpu_gpt, tiny_transformer_config
    from verl_fused_hook_harness.support.hf_model import TINY_QWEN2
    from verl_fused_hook_harness.support.mtp_engine import build_mtp_engine, mtp_forward, take_mtp_metrics

    _, sp, tied, layers, per_token = CASES[name]
    results = {}
    for side in ("verl", "hook"):
        config = tiny_transformer_config(sequence_parallel=sp, mtp_num_layers=layers)
        config.mtp_loss_scaling_factor = 0.3
        config.calculate_per_token_loss = per_token
        model = build_cpu_gpt(config, vocab_size=VOCAB, tied=tied)
        engine = build_mtp_engine(model, hook=side == "hook", backend="torch", model_path=TINY_QWEN2)
        batch = rl_batch(per_token)
        take_mtp_metrics()
        # hook mode scores the response rows only (what verl's loss reads); compare those
        log_probs = mtp_forward(engine, model, batch)["log_probs"].values()[response_score_rows(batch, None).values()]
        grad_out = torch.randn(log_probs.shape, generator=torch.Generator().manual_seed(3))
        (log_probs * grad_out).sum().backward()
        results[side] = dict(
            fused=engine.engine_config.use_fused_kernels,
            log_probs=log_probs.detach(),
            grads={key: p.grad.clone() for key, p in model.named_parameters() if p.grad is not None},
            metrics=take_mtp_metrics(),
        )
    return results


WORLD, CP = 4, 2


def cp_worker(rank, world_size, names):
    """Every case at CP=2 and at CP=1 (its reference), in one set of processes: the parallel state is
    rebuilt per (TP, CP); ranks beyond TP x CP are data-parallel replicas. Process start-ups cost most."""
    from verl_fused_hook.verl_integration import install
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel

    install()
    import verl.workers.engine.megatron.transformer_impl  # noqa: F401  (fires the plugin's build gate)

    results = {}
    for tp in sorted({CASES[name][0] for name in names}):
        for cp in (CP, 1):
            init_model_parallel(tp, cp_size=cp)
            results.update({(name, cp): run_case(name) for name in names if CASES[name][0] == tp})
    return results


def relative_error(got, want):
    scale = want.double().abs().max().clamp_min(1e-30)
    return ((got.double() - want.double()).abs().max() / scale).item()


@pytest.fixture(scope="module")
def runs():
    """Per case: every rank's CP=2 results, the CP ranks of TP rank 0 in the first data-parallel replica
    (megatron's rank order: TP fastest, then CP), and every rank's CP=1 reference."""
    ranks = run_in_processes(cp_worker, WORLD, list(CASES))
    results = {}
    for name, (tp, *_rest) in CASES.items():
        results[name] = dict(
            every_rank=[rank[name, CP] for rank in ranks],
            cp_ranks=[rank[name, CP] for rank in ranks[0 : tp * CP : tp]],
            reference=[rank[name, 1] for rank in ranks],
        )
    return results


@pytest.mark.parametrize("name", CASES)
def test_fused_mtp_loss_under_context_parallelism_matches_megatrons(runs, name):
    for rank, result in enumerate(runs[name]["every_rank"]):
        verl, hook = result["verl"], result["hook"]
        assert (verl["fused"], hook["fused"]) == (False, True)
        assert relative_error(hook["log_probs"], verl["log_probs"]) <= RTOL, rank
        assert sorted(hook["grads"]) == sorted(verl["grads"]), rank
        assert sum(key.startswith("mtp.") for key in hook["grads"]) > 3, "the MTP layers must train"
        errors = {key: relative_error(hook["grads"][key], want) for key, want in verl["grads"].items()}
        worst = max(errors, key=errors.get)
        assert errors[worst] <= RTOL, (rank, worst, errors[worst])
        assert set(hook["metrics"]) == set(verl["metrics"]) == {"loss_values", "correct_values", "total_values"}
        for key, want in verl["metrics"].items():
            assert relative_error(hook["metrics"][key], want) <= RTOL, (rank, key, hook["metrics"][key], want)


@pytest.mark.parametrize("name", CASES)
def test_context_parallel_ranks_together_score_what_one_rank_scores(runs, name):
    cp_ranks, reference = runs[name]["cp_ranks"], runs[name]["reference"]
    layers = CASES[name][3]
    for side in ("verl", "hook"):
        want = reference[0][side]
        for replica in reference[1:]:  # data-parallel replicas at CP=1 (and TP ranks)
            assert relative_error(replica[side]["log_probs"], want["log_probs"]) <= RTOL, side
        for result in runs[name]["every_rank"]:
            assert relative_error(result[side]["log_probs"], want["log_probs"]) <= RTOL, side
        # rows = MTP layers; each CP rank logs its own tokens' counts and mean loss (megatron averages later)
        total = sum(result[side]["metrics"]["total_values"][:layers] for result in cp_ranks)
        correct = sum(result[side]["metrics"]["correct_values"][:layers] for result in cp_ranks)
        loss_sum = sum(
            result[side]["metrics"]["loss_values"][:layers] * result[side]["metrics"]["total_values"][:layers]
            for result in cp_ranks
        )
        metrics = want["metrics"]
        assert torch.equal(total, metrics["total_values"][:layers]) and bool(total.gt(0).all()), side
        assert torch.equal(correct, metrics["correct_values"][:layers]), side
        assert relative_error(loss_sum, metrics["loss_values"][:layers] * metrics["total_values"][:layers]) <= RTOL, (
            side
        )
