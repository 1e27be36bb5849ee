"""The fused policy loss (`log_probs_entropy_and_loss`) against verl's own `ppo_loss` on the op's outputs.

Reference: `log_probs_and_entropy` (itself checked against fp64 in test_op.py), then
verl 0.9.1's `ppo_loss` on its log-probs and entropy, then autograd. The fused op must
give the same loss, the same metrics and the same hidden/weight gradients (fp32,
1e-5 relative), for every supported ppo_loss configuration, under a score mask,
mixed temperatures and TP=2 (gloo); and must refuse what it cannot do exactly.
"""

from __future__ import annotations

import dataclasses
import logging
from functools import partial

import pytest
import torch
import torch.distributed as dist

from verl_fused_hook import log_probs_and_entropy
from verl_fused_hook.ops import LossGradientError, NonSeparableLossError, log_probs_entropy_and_loss
from verl_fused_hook.verl_integration.loss_support import (
    SUPPORTED_AGG_MODES,
    SUPPORTED_KL_LOSS_TYPES,
    ppo_loss_name,
    ppo_loss_separability,
    unsupported_reason,
)
from verl_fused_hook.verl_integration.ppo_loss import ppo_loss_of_rows, ppo_loss_on_host, ppo_row_gradients
from verl_fused_hook_harness.support.distributed import run_in_processes

PROMPT_LENS = (4, 6, 3, 5)
RESPONSE_LENS = (5, 2, 7, 6)
VOCAB, HIDDEN = 53, 16
RTOL = 1e-5
CHUNK_ROWS = 4  # several chunks per call


def actor_config(**overrides):
    from verl.workers.config import ActorConfig

    base = ActorConfig(strategy="megatron", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    policy_loss = overrides.pop("loss_mode", None)
    config = dataclasses.replace(base, **overrides)
    if policy_loss is not None:
        config = dataclasses.replace(config, policy_loss=dataclasses.replace(config.policy_loss, loss_mode=policy_loss))
    return config


def nested(parts):
    return torch.nested.as_nested_tensor(list(parts), layout=torch.jagged)


def offsets():
    return torch.tensor([0, *torch.tensor(PROMPT_LENS) + torch.tensor(RESPONSE_LENS)]).cumsum(0)


def rl_data(global_info: bool, rollout_weights: bool = True):
    """A verl actor-update micro-batch: jagged prompts/responses plus the per-response-token fields ppo_loss reads."""
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in PROMPT_LENS]
    responses = [torch.randint(0, VOCAB, (n,), generator=g) for n in RESPONSE_LENS]
    masks = [torch.rand(n, generator=g) > 0.2 for n in RESPONSE_LENS]
    tensors = {
        "input_ids": nested(torch.cat(pair) for pair in zip(prompts, responses)),
        "prompts": nested(prompts),
        "responses": nested(responses),
        "response_mask": nested(m.long() for m in masks),
        # old log-probs near typical values so ratios straddle both clip bounds
        "old_log_probs": nested(-torch.rand(n, generator=g) * 4 for n in RESPONSE_LENS),
        "advantages": nested(torch.randn(n, generator=g) for n in RESPONSE_LENS),
        "ref_log_prob": nested(-torch.rand(n, generator=g) * 4 for n in RESPONSE_LENS),
    }
    if rollout_weights:
        tensors["rollout_is_weights"] = nested(torch.rand(n, generator=g) + 0.5 for n in RESPONSE_LENS)
    batch_info = (
        dict(dp_size=2, batch_num_tokens=57, global_batch_size=9)
        if global_info
        else dict(dp_size=1, batch_num_tokens=None, global_batch_size=None)
    )
    return tu.get_tensordict(tensors, non_tensor_dict=batch_info)


def op_inputs():
    g = torch.Generator().manual_seed(5)
    rows = int(offsets()[-1])
    hidden = torch.randn(rows, HIDDEN, generator=g)
    weight = torch.randn(VOCAB + 3, HIDDEN, generator=g) * 0.6  # 3 padding columns
    labels = torch.randint(0, VOCAB, (rows,), generator=g)
    per_sequence = torch.tensor([0.6, 1.0, 1.3, 0.9])
    temperature = per_sequence.repeat_interleave(offsets().diff())
    return hidden, weight, labels, temperature


def response_rows():
    """The rows verl's no_padding_2_padding reads: predictions of response tokens."""
    mask = torch.zeros(int(offsets()[-1]), dtype=torch.bool)
    for start, p, r in zip(offsets()[:-1].tolist(), PROMPT_LENS, RESPONSE_LENS):
        mask[start + p - 1 : start + p + r - 1] = True
    return mask


def to_nested(rows):
    return torch.nested.nested_tensor_from_jagged(rows, offsets=offsets())


def loss_of_rows(config, data):
    from verl.workers.utils.losses import ppo_loss

    return ppo_loss_of_rows(partial(ppo_loss, config=config), data, to_nested)


def row_gradients_of(config, data):
    return ppo_row_gradients(config, data, to_nested, torch.Size([int(offsets()[-1])]), "cpu")


def host_loss_of(config, data):
    """ppo_loss_on_host as hook mode builds it; on the CPU the "host" data is the batch itself, so this checks
    the row mapping and the op's host evaluation (the CUDA copies are tests/gpu/test_fused_loss_cuda.py's)."""
    from verl.workers.utils.losses import ppo_loss

    return ppo_loss_on_host(partial(ppo_loss, config=config), data, to_nested, torch.Size([int(offsets()[-1])]), "cpu")


def metric_values(metrics):
    from verl.utils.metric import Metric

    out = {}
    for key, value in metrics.items():
        if isinstance(value, Metric):
            out[key] = (value.aggregation, float(value.aggregate()))
        else:
            out[key] = float(value)
    return out


def run_both(config, data, *, score_mask=None, tp_group=None, weight_shard=None, vocab_size=VOCAB):
    hidden, weight, labels, temperature = op_inputs()
    weight = weight if weight_shard is None else weight_shard
    loss_fn = loss_of_rows(config, data)
    common = dict(temperature=temperature, tp_group=tp_group, score_mask=score_mask, vocab_size=vocab_size)

    h_ref, w_ref = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = log_probs_and_entropy(h_ref, w_ref, labels, backend="torch", tile_rows=CHUNK_ROWS, **common)
    want_loss, want_metrics = loss_fn(lp, ent)
    want_loss.backward()

    def fused(row_gradients, host_loss_fn=None):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        result = log_probs_entropy_and_loss(
            h,
            w,
            labels,
            loss_fn=loss_fn,
            loss_name=ppo_loss_name(config),
            chunk_rows=CHUNK_ROWS,
            row_gradients=row_gradients,
            host_loss_fn=host_loss_fn,
            **common,
        )
        result.loss.backward()
        return (
            result.loss.detach(),
            metric_values(result.metrics),
            result.log_probs.detach(),
            result.entropy.detach(),
            h.grad,
            w.grad,
        )

    return dict(
        want=(want_loss.detach(), metric_values(want_metrics), lp.detach(), ent.detach(), h_ref.grad, w_ref.grad),
        got=fused(None),  # loss_fn differentiated per chunk
        got_row_gradients=fused(row_gradients_of(config, data)),  # the elementwise per-row gradients
        got_host=fused(
            row_gradients_of(config, data), host_loss_of(config, data)
        ),  # hook mode: final evaluation on the host
    )


def assert_same(want, got):
    want_loss, want_metrics, want_lp, want_ent, want_dh, want_dw = want
    loss, metrics, lp, ent, dh, dw = got
    torch.testing.assert_close(loss, want_loss, rtol=RTOL, atol=RTOL * float(want_loss.abs().clamp_min(1e-3)))
    assert metrics.keys() == want_metrics.keys()
    for key, value in want_metrics.items():
        if isinstance(value, tuple):
            assert metrics[key][0] == value[0], key
            assert metrics[key][1] == pytest.approx(value[1], rel=RTOL, abs=1e-7), key
        else:
            assert metrics[key] == pytest.approx(value, rel=RTOL, abs=1e-7), key
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-6)
    for grad, want_grad in ((dh, want_dh), (dw, want_dw)):
        scale = float(want_grad.abs().max())
        assert scale > 0
        assert float((grad - want_grad).abs().max()) <= RTOL * scale


CONFIGS = {
    # every aggregation, with and without verl's global-batch normalisation
    **{
        f"{agg}-{'global' if global_info else 'local'}": (dict(loss_agg_mode=agg, entropy_coeff=0.01), global_info)
        for agg in SUPPORTED_AGG_MODES
        for global_info in (False, True)
    },
    "seq-mean-token-sum-norm-scale-factor": (
        dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=16, entropy_coeff=0.01),
        True,
    ),
    # clipping: asymmetric bounds and a tight dual clip
    "clip-asymmetric-dual": (
        dict(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=1.5, entropy_coeff=0.0),
        False,
    ),
    # every KL loss type, with the entropy bonus
    **{
        f"kl-{kind}": (dict(use_kl_loss=True, kl_loss_type=kind, kl_loss_coef=0.1, entropy_coeff=0.003), True)
        for kind in SUPPORTED_KL_LOSS_TYPES
    },
}


@pytest.mark.parametrize("masked", [False, True], ids=["all-rows", "score-mask"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_loss_equals_ppo_loss_on_the_op(name, masked):
    overrides, global_info = CONFIGS[name]
    config = actor_config(**overrides)
    assert unsupported_reason(config) is None
    outcome = run_both(config, rl_data(global_info), score_mask=response_rows() if masked else None)
    for variant in ("got", "got_row_gradients", "got_host"):
        assert_same(outcome["want"], outcome[variant])


def test_fused_loss_without_rollout_weights():
    outcome = run_both(actor_config(entropy_coeff=0.01), rl_data(True, rollout_weights=False))
    for variant in ("got", "got_row_gradients", "got_host"):
        assert_same(outcome["want"], outcome[variant])


def test_sequence_level_loss_is_refused_by_the_separability_guard():
    config = actor_config(loss_mode="gspo", loss_agg_mode="seq-mean-token-mean")
    assert ppo_loss_separability(config) == ("sequence", None)  # fused only with its sequences kept whole
    hidden, weight, labels, temperature = op_inputs()
    with pytest.raises(NonSeparableLossError, match="gspo"):
        log_probs_entropy_and_loss(
            hidden.requires_grad_(True),
            weight,
            labels,
            loss_fn=loss_of_rows(config, rl_data(False)),
            loss_name=ppo_loss_name(config),
            temperature=temperature,
            chunk_rows=CHUNK_ROWS,
        )


def test_row_gradients_that_disagree_with_the_loss_are_refused():
    config = actor_config(entropy_coeff=0.01)
    data = rl_data(False)
    right = row_gradients_of(config, data)

    def off_by_a_little(rows, log_prob, entropy):
        g_lp, g_ent = right(rows, log_prob, entropy)
        return g_lp * 1.001, g_ent

    hidden, weight, labels, temperature = op_inputs()
    with pytest.raises(NonSeparableLossError, match="row_gradients disagree"):
        log_probs_entropy_and_loss(
            hidden.requires_grad_(True),
            weight,
            labels,
            loss_fn=loss_of_rows(config, data),
            loss_name="ppo",
            temperature=temperature,
            chunk_rows=CHUNK_ROWS,
            row_gradients=off_by_a_little,
        )


def test_host_loss_that_is_not_the_loss_is_refused():
    config = actor_config(entropy_coeff=0.01)
    data = rl_data(False)
    host = host_loss_of(actor_config(entropy_coeff=0.02), data)  # another entropy coefficient
    hidden, weight, labels, temperature = op_inputs()
    with pytest.raises(NonSeparableLossError, match="host_loss_fn"):
        log_probs_entropy_and_loss(
            hidden.requires_grad_(True),
            weight,
            labels,
            loss_fn=loss_of_rows(config, data),
            loss_name="ppo",
            temperature=temperature,
            chunk_rows=CHUNK_ROWS,
            row_gradients=row_gradients_of(config, data),
            host_loss_fn=host,
        )


def test_host_loss_runs_on_one_intra_op_thread_and_restores_the_count():
    """The final evaluation on the host runs single-threaded (OpenMP teams stalled whole steps on the GPU machine);
    the caller's thread count comes back after it, also when the evaluation raises."""
    config = actor_config(entropy_coeff=0.01)
    data = rl_data(False)
    host = host_loss_of(config, data)
    seen = []

    def recording(lp, ent):
        seen.append(torch.get_num_threads())
        return host(lp, ent)

    def failing(lp, ent):
        raise RuntimeError("host loss failed")

    hidden, weight, labels, temperature = op_inputs()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for host_loss_fn in (recording, failing):
            call = partial(
                log_probs_entropy_and_loss,
                hidden.clone().requires_grad_(True),
                weight,
                labels,
                loss_fn=loss_of_rows(config, data),
                loss_name="ppo",
                temperature=temperature,
                chunk_rows=CHUNK_ROWS,
                row_gradients=row_gradients_of(config, data),
                host_loss_fn=host_loss_fn,
            )
            if host_loss_fn is failing:
                with pytest.raises(RuntimeError, match="host loss failed"):
                    call()
            else:
                call()
            assert torch.get_num_threads() == 2
        assert seen and set(seen) == {1}
    finally:
        torch.set_num_threads(before)


def test_chunk_bytes_sets_the_chunk_and_not_the_result():
    """The portable passes' chunk is chunk_bytes of fp32 logits: loss_fn (no row_gradients) is called once per
    chunk and once at the end; the result equals one chunk's."""
    config = actor_config(entropy_coeff=0.01)
    data = rl_data(True)
    inner = loss_of_rows(config, data)
    calls = []

    def counting(lp, ent):
        calls.append(1)
        return inner(lp, ent)

    hidden, weight, labels, temperature = op_inputs()
    outcomes = []
    for chunk_bytes in (4 * VOCAB * 7, 1 << 30):  # 7 rows (vocab_size=VOCAB: the padding columns are not computed)
        calls.clear()
        h = hidden.clone().requires_grad_(True)
        result = log_probs_entropy_and_loss(
            h,
            weight,
            labels,
            loss_fn=counting,
            loss_name="ppo",
            temperature=temperature,
            vocab_size=VOCAB,
            chunk_bytes=chunk_bytes,
        )
        result.loss.backward()
        outcomes.append((len(calls), result.loss.detach(), h.grad))
    rows = int(offsets()[-1])
    assert outcomes[0][0] == -(-rows // 7) + 1 and outcomes[1][0] == 2
    torch.testing.assert_close(outcomes[0][1], outcomes[1][1], rtol=RTOL, atol=0)
    assert float((outcomes[0][2] - outcomes[1][2]).abs().max()) <= RTOL * float(outcomes[1][2].abs().max())


def test_host_loss_is_not_built_from_a_jagged_tensor_with_holes(caplog):
    from verl.workers.utils.losses import ppo_loss

    def with_holes(rows):  # each sequence one value shorter than its span: what a plain gather cannot rebuild
        return torch.nested.nested_tensor_from_jagged(rows, offsets=offsets(), lengths=offsets().diff() - 1)

    loss = partial(ppo_loss, config=actor_config())
    with caplog.at_level(logging.INFO, logger="verl_fused_hook.verl_integration.ppo_loss"):
        host = ppo_loss_on_host(loss, rl_data(False), with_holes, torch.Size([int(offsets()[-1])]), "cpu")
    assert host is None
    assert any("jagged tensor with holes" in record.getMessage() for record in caplog.records)


def test_gradient_reaching_the_returned_log_probs_is_refused():
    config = actor_config()
    hidden, weight, labels, temperature = op_inputs()
    hidden.requires_grad_(True)
    result = log_probs_entropy_and_loss(
        hidden,
        weight,
        labels,
        loss_fn=loss_of_rows(config, rl_data(False)),
        loss_name=ppo_loss_name(config),
        temperature=temperature,
        chunk_rows=CHUNK_ROWS,
    )
    with pytest.raises(LossGradientError, match="vanilla"):
        (result.loss + 0.5 * result.entropy.sum()).backward()


def test_without_gradients_it_only_evaluates_the_loss():
    config = actor_config(entropy_coeff=0.01)
    hidden, weight, labels, temperature = op_inputs()
    loss_fn = loss_of_rows(config, rl_data(True))
    with torch.no_grad():
        result = log_probs_entropy_and_loss(
            hidden, weight, labels, loss_fn=loss_fn, loss_name="ppo", temperature=temperature, vocab_size=VOCAB
        )
        lp, ent = log_probs_and_entropy(hidden, weight, labels, temperature=temperature, vocab_size=VOCAB)
        want, _ = loss_fn(lp, ent)
    assert result.loss.grad_fn is None
    torch.testing.assert_close(result.loss, want, rtol=RTOL, atol=0)


def test_bad_arguments_name_the_field():
    hidden, weight, labels, _ = op_inputs()
    with pytest.raises(ValueError, match="loss_fn"):
        log_probs_entropy_and_loss(hidden, weight, labels, loss_fn=None, loss_name="x")
    with pytest.raises(ValueError, match="loss_name"):
        log_probs_entropy_and_loss(hidden, weight, labels, loss_fn=lambda lp, ent: (lp.sum(), {}), loss_name="")
    with pytest.raises(ValueError, match="chunk_bytes: expected None or an int >= 1"):
        log_probs_entropy_and_loss(
            hidden, weight, labels, loss_fn=lambda lp, ent: (lp.sum(), {}), loss_name="x", chunk_bytes=0.5
        )
    with pytest.raises(ValueError, match="host_loss_fn: expected None or a callable"):
        log_probs_entropy_and_loss(
            hidden, weight, labels, loss_fn=lambda lp, ent: (lp.sum(), {}), loss_name="x", host_loss_fn=1
        )
    with pytest.raises(ValueError, match="temperature"):  # the shared checks of log_probs_and_entropy
        log_probs_entropy_and_loss(
            hidden, weight, labels, loss_fn=lambda lp, ent: (lp.sum(), {}), loss_name="x", temperature=0.0
        )


def tp_worker(rank, world_size):
    """Two vocabulary shards; each rank returns its loss, metrics, outputs and gradients of both paths."""
    _, weight, _, _ = op_inputs()
    shard = weight.chunk(world_size)[rank].clone()
    config = actor_config(loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_type="k3", entropy_coeff=0.01)
    return run_both(config, rl_data(True), score_mask=response_rows(), tp_group=dist.group.WORLD, weight_shard=shard)


def test_tp2_gloo_matches_the_unfused_op_on_every_rank():
    results = run_in_processes(tp_worker, 2)
    for outcome in results:
        for variant in ("got", "got_row_gradients", "got_host"):
            assert_same(outcome["want"], outcome[variant])
    # every rank reports the same loss
    torch.testing.assert_close(results[0]["got"][0], results[1]["got"][0], rtol=0, atol=0)


# ---------------------------------------------------------------- through verl's engine (real GPTModel, CPU)

ENGINE_VOCAB = 192


def engine_batch(config_global: bool):
    """A micro-batch as verl's actor update hands it to forward_step: ids, masks, ppo_loss fields, batch info."""
    from verl.utils import tensordict_utils as tu

    data = rl_data(config_global)
    g = torch.Generator().manual_seed(9)
    tensors = {key: data[key] for key in data.keys() if key not in ("dp_size", "batch_num_tokens", "global_batch_size")}
    tensors["input_ids"] = nested(torch.randint(0, ENGINE_VOCAB, (int(n),), generator=g) for n in offsets().diff())
    tensors["loss_mask"] = nested(
        torch.cat([torch.zeros(p), torch.ones(r)]).long() for p, r in zip(PROMPT_LENS, RESPONSE_LENS)
    )
    tensors["temperature"] = torch.tensor([0.7, 1.0, 0.5, 0.9])
    non_tensor = {key: data[key] for key in ("dp_size", "batch_num_tokens", "global_batch_size")}
    return tu.get_tensordict(tensors, non_tensor_dict={**non_tensor, "calculate_entropy": True, "num_micro_batch": 1})


def engine_step(fused: bool, loss_config, spy: list, **extra_options):
    from verl.workers.utils.losses import ppo_loss

    from verl_fused_hook_harness.stand_ins.megatron_cpu import build_cpu_gpt, tiny_transformer_config
    from verl_fused_hook_harness.support.verl_engine import megatron_engine

    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=ENGINE_VOCAB, seed=7)
    options = {
        "use_output_processor_hook": True,
        "output_processor_backend": "torch",
        "output_processor_fused_loss": fused,
    }
    options.update(extra_options)
    engine = megatron_engine([model], fused_kernel_options=options)
    engine._maybe_enable_fused_kernels()
    loss_function = partial(ppo_loss, config=loss_config)
    postprocess = partial(engine.postprocess_micro_batch_func, forward_only=False, loss_function=loss_function)
    calls_before = len(spy)
    output, finish = engine.forward_step(iter([engine_batch(True)]), model, loss_function, postprocess)
    scaled_loss, report = finish(output)
    scaled_loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return report, grads, len(spy) - calls_before


@pytest.fixture
def verl_hook_mode(monkeypatch):
    """verl with the plugin installed and megatron's parallel state on one CPU rank; verl (and, when this
    fixture created it, the absence of a process group) restored after."""
    from verl_fused_hook.switch import ENV_VAR
    from verl_fused_hook.verl_integration import call_sites, install
    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel

    monkeypatch.delenv(ENV_VAR, raising=False)
    had_process_group = dist.is_initialized()
    init_model_parallel(1)
    install()
    import verl.workers.engine.megatron.transformer_impl as transformer_impl

    import verl_fused_hook.hook as hook

    spy = []
    real = hook.log_probs_entropy_and_loss

    def counting(*args, **kwargs):  # the real op, counted: proves the fused path ran
        spy.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(hook, "log_probs_entropy_and_loss", counting)
    yield spy
    call_sites.restore()
    call_sites.install_build_gate(transformer_impl)
    if not had_process_group:  # later tests (e.g. test_op's tp_group check) expect no process group
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "overrides",
    [
        dict(loss_agg_mode="token-mean", entropy_coeff=0.01),
        dict(
            loss_agg_mode="seq-mean-token-mean",
            entropy_coeff=0.01,
            use_kl_loss=True,
            kl_loss_type="k3",
            kl_loss_coef=0.1,
        ),
    ],
    ids=["token-mean", "seq-mean-token-mean-kl"],
)
def test_verl_forward_step_with_fused_loss_reports_what_ppo_loss_reports(verl_hook_mode, overrides):
    config = actor_config(**overrides)
    two_pass, two_pass_grads, fused_calls = engine_step(False, config, verl_hook_mode)
    assert fused_calls == 0
    fused, fused_grads, fused_calls = engine_step(True, config, verl_hook_mode)
    assert fused_calls == 1
    assert callable(verl_hook_mode[-1]["host_loss_fn"])  # hook mode evaluates the loss on the host
    assert fused["loss"] == pytest.approx(two_pass["loss"], rel=RTOL)
    assert metric_values(fused["metrics"]).keys() == metric_values(two_pass["metrics"]).keys()
    for key, value in metric_values(two_pass["metrics"]).items():
        got = metric_values(fused["metrics"])[key]
        if isinstance(value, tuple):
            assert got[0] == value[0] and got[1] == pytest.approx(value[1], rel=RTOL, abs=1e-7), key
        else:
            assert got == pytest.approx(value, rel=RTOL, abs=1e-7), key
    torch.testing.assert_close(
        fused["model_output"]["log_probs"].values(), two_pass["model_output"]["log_probs"].values(), rtol=0, atol=1e-6
    )
    assert "verl_fused_hook_loss" not in fused["model_output"]
    assert fused_grads.keys() == two_pass_grads.keys()
    for name, want in two_pass_grads.items():
        scale = float(want.abs().max())
        assert float((fused_grads[name] - want).abs().max()) <= RTOL * max(scale, 1e-6), name


def test_fused_loss_chunk_entry_reaches_the_op(verl_hook_mode):
    config = actor_config(entropy_coeff=0.01)
    engine_step(True, config, verl_hook_mode, output_processor_fused_loss_chunk_gib=0.5)
    assert verl_hook_mode[-1]["chunk_bytes"] == 512 * 1024**2


def test_unsupported_loss_mode_runs_the_two_pass_path_and_says_so(verl_hook_mode, caplog):
    config = actor_config(loss_mode="clip_cov", loss_agg_mode="token-mean")
    with caplog.at_level(logging.INFO, logger="verl_fused_hook.verl_integration.loss_support"):
        report, _, fused_calls = engine_step(True, config, verl_hook_mode)
    assert fused_calls == 0
    assert any(
        "loss_mode=clip_cov" in record.getMessage() and "two-pass" in record.getMessage() for record in caplog.records
    )
    assert report["loss"] != 0


def test_fused_loss_entry_is_validated():
    from verl_fused_hook.switch import resolve_plan

    with pytest.raises(ValueError, match="output_processor_fused_loss"):
        resolve_plan({"use_output_processor_hook": True, "output_processor_fused_loss": "yes"}, environ={})
    with pytest.raises(ValueError, match="output_processor_fused_loss"):
        resolve_plan(
            {
                "use_output_processor_hook": True,
                "output_processor_backend": "verl",
                "output_processor_fused_loss": True,
            },
            environ={},
        )
    assert resolve_plan({"use_output_processor_hook": True, "output_processor_fused_loss": True}, environ={}).fused_loss
    for bad in ("2", 0, -1.0, float("nan"), True):
        with pytest.raises(
            ValueError, match=r"output_processor_fused_loss_chunk_gib=.* is not allowed; use a number of GiB > 0"
        ):
            resolve_plan(
                {
                    "use_output_processor_hook": True,
                    "output_processor_fused_loss": True,
                    "output_processor_fused_loss_chunk_gib": bad,
                },
                environ={},
            )
    chunked = resolve_plan(
        {
            "use_output_processor_hook": True,
            "output_processor_fused_loss": True,
            "output_processor_fused_loss_chunk_gib": 1.5,
        },
        environ={},
    )
    assert chunked.fused_loss_chunk_bytes == 3 * 512 * 1024**2
    assert "output_processor_fused_loss_chunk_gib=1.5" in chunked.log_line("MegatronEngineWithLMHead")
    unused = resolve_plan({"use_output_processor_hook": True, "output_processor_fused_loss_chunk_gib": 2}, environ={})
    assert unused.fused_loss_chunk_bytes is None and "chunk_gib ignored: the fused loss is off" in unused.note
    off = resolve_plan({"use_output_processor_hook": False, "output_processor_fused_loss": True}, environ={})
    assert not off.fused_loss and "ignored outside hook mode" in off.note


# ---------------------------------------------------------------- the bench's loss methods (run on the GPU by the
# bench)


@pytest.mark.parametrize("mode", ["vanilla", "gspo"])
def test_bench_loss_methods_agree_with_each_other_and_fp64_on_cpu(mode):
    """fused_loss and verl_loss (and their _gspo twins) compute the same loss and gradients; verl's Triton kernel
    needs CUDA, so
    verl_loss's kernel is stood in for by the portable op here (a fake of verl's kernel, named so)."""
    from verl_fused_hook_harness.commands.bench import op_bench as bench
    from verl_fused_hook_harness.commands.bench import policy_loss as bench_loss

    def fake_verl_kernel(h, w, labels, temperature, score_mask=None):
        return log_probs_and_entropy(h, w, labels, temperature=temperature, backend="torch")

    g = torch.Generator().manual_seed(2)
    n, h, v = 2 * bench_loss.SEQUENCE_TOKENS, 8, 40
    hidden, weight = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    fused, verl = bench_loss.fused_loss_method(mode), bench_loss.verl_loss_method(fake_verl_kernel, mode)
    fused_grads = bench._fwd_bwd(fused, hidden, weight, labels, 0.7, None, None)
    verl_grads = bench._fwd_bwd(verl, hidden, weight, labels, 0.7, None, None)
    for got, want in zip(fused_grads, verl_grads):
        assert float((got - want).abs().max()) <= RTOL * float(want.abs().max())
    accuracy = bench_loss.loss_accuracy(fused, hidden, weight, labels, 0.7)
    assert (
        accuracy["loss_rel_err"] < 1e-5 and accuracy["d_hidden_rel_err"] < 1e-5 and accuracy["d_weight_rel_err"] < 1e-5
    )
    table = bench.markdown(
        {
            "methods": ["floor", "fused_loss", "verl_loss"],
            "shapes": [
                {
                    "N": n,
                    "H": h,
                    "V": v,
                    "floor": {"fwd_bwd_ms": 4.0, "fwd_bwd_3gemm_ms": 3.0, "gemm_ms": 1.0},
                    "fused_loss": {"fwd_bwd_ms": 3.2},
                    "verl_loss": {"fwd_bwd_ms": 6.4},
                }
            ],
        }
    )
    assert "| 3.0 ms (0.75x) | 3.2 ms (0.80x) | 6.4 ms (1.60x) |" in table and "2.00x" in table


def test_processor_context_refuses_a_loss_without_the_op():
    from verl_fused_hook import FusedOutputProcessorContext

    def loss_fn(lp, ent):
        return lp.sum(), {}

    with pytest.raises(ValueError, match="loss_fn"):
        FusedOutputProcessorContext(loss_fn=loss_fn, backend="verl")
    with pytest.raises(ValueError, match="loss_fn"):
        FusedOutputProcessorContext(loss_fn=loss_fn, as_tuple=True)
    for name, value in (("row_gradients", loss_fn), ("host_loss_fn", loss_fn), ("loss_chunk_bytes", 1024)):
        with pytest.raises(
            ValueError, match=f"FusedOutputProcessorContext.{name}: belongs to a fused loss; set loss_fn"
        ):
            FusedOutputProcessorContext(**{name: value})
    with pytest.raises(ValueError, match="FusedOutputProcessorContext.loss_chunk_bytes: expected None or an int >= 1"):
        FusedOutputProcessorContext(loss_fn=loss_fn, loss_chunk_bytes=2.5)
