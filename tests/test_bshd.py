"""Hook mode on verl's padded (BSHD) layout (`use_remove_padding=False`), real verl 0.9.1 and megatron-core 0.19.2 on
the CPU.

The reference is verl's own unfused BSHD path: `MegatronEngineWithLMHead.forward_step`
with fused kernels off runs `gptmodel_forward_model_engine(data_format="bshd")` and
verl's logits processor over full logits. Hook mode runs the same `forward_step`
with fused kernels kept on, which routes to the engine forward's padded layout. Batches are verl's RL
layout (left-padded prompts, right-padded responses) turned into its engine input
by verl's `left_right_2_no_padding`. Context parallelism runs on the CPU through
the test-only CP attention (`testing/cp_attention.py`), on both sides alike.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from output_rows import OutputWeightRows

from verl_fused_hook.switch import ENV_VAR
from verl_fused_hook.verl_integration import call_sites, install
from verl_fused_hook_harness.stand_ins.megatron_cpu import build_cpu_gpt, init_model_parallel, tiny_transformer_config
from verl_fused_hook_harness.support.verl_engine import megatron_engine

VOCAB = 192  # no other layer of the tiny model has 192 output features, so output-weight matmuls are countable
TEMPERATURES = (0.7, 1.0, 0.5)
PADDINGS = {  # prompt lengths (left-padded), response lengths (right-padded)
    "left": ((4, 6, 3), (5, 5, 5)),
    "right": ((5, 5, 5), (5, 2, 7)),
    "both": ((4, 6, 3), (5, 2, 7)),
}
RELATIVE = 1e-5  # fp32: max |hook - verl| <= 1e-5 * max |verl|, per tensor

install()
import verl.workers.engine.megatron.transformer_impl as transformer_impl  # noqa: E402  (fires install's gate)
from verl.models.mcore import model_forward_fused  # noqa: E402

# ---------------------------------------------------------------- helpers (module level: gloo workers import them)


def padded_rl_batch(padding: str, temperatures=TEMPERATURES, seed: int = 0):
    """verl's RL batch (left-padded prompts, right-padded responses) through verl's `left_right_2_no_padding`."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    prompt_lens, response_lens = PADDINGS[padding]
    generator = torch.Generator().manual_seed(seed)
    width_p, width_r = max(prompt_lens), max(response_lens)
    prompts = torch.zeros(len(prompt_lens), width_p, dtype=torch.long)
    responses = torch.zeros(len(prompt_lens), width_r, dtype=torch.long)
    attention_mask = torch.zeros(len(prompt_lens), width_p + width_r, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        prompts[i, width_p - p :] = torch.randint(1, VOCAB, (p,), generator=generator)
        responses[i, :r] = torch.randint(1, VOCAB, (r,), generator=generator)
        attention_mask[i, width_p - p : width_p + r] = 1
    data = tu.get_tensordict(
        {
            "input_ids": torch.cat([prompts, responses], dim=1),
            "prompts": prompts,
            "responses": responses,
            "attention_mask": attention_mask,
            "response_mask": attention_mask[:, width_p:].clone(),
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp_min(0),
            "temperature": torch.tensor(temperatures, dtype=torch.float32),
        },
        non_tensor_dict={"calculate_entropy": True},
    )
    return left_right_2_no_padding(data)


def forward_step(engine, model, batch, loss_function=None):
    output, _ = engine.forward_step(iter([batch]), model, loss_function, lambda output, **_: output)
    return output


def sft_loss_function():
    from functools import partial

    from verl.workers.utils.losses import sft_loss

    return partial(sft_loss, config=None)


def bshd_engine(mode: str, sequence_parallel: bool = False):
    """A BSHD engine (use_remove_padding=False) over a fresh seeded model: verl's unfused path or hook mode."""
    os.environ.pop(ENV_VAR, None)
    model = build_cpu_gpt(tiny_transformer_config(sequence_parallel=sequence_parallel), vocab_size=VOCAB, seed=7)
    if mode == "verl":
        engine = megatron_engine([model], use_fused_kernels=False, use_remove_padding=False)
    else:
        os.environ[ENV_VAR] = "1"
        engine = megatron_engine(
            [model], fused_kernel_options={"output_processor_backend": "torch"}, use_remove_padding=False
        )
    engine._maybe_enable_fused_kernels()
    return engine, model


def train_step(engine, model, padding: str, loss_function=None):
    """forward_step, a loss over the rows verl reads (per-position weights), backward; read values, grads, rows."""
    from verl.workers.utils.padding import no_padding_2_padding

    batch = padded_rl_batch(padding)
    from megatron.core import parallel_state

    vocab_local = VOCAB // parallel_state.get_tensor_model_parallel_world_size()
    counter = OutputWeightRows(model.config.hidden_size, vocab_local)
    with counter:
        output = forward_step(engine, model, batch, loss_function)
    read = {key: no_padding_2_padding(output[key], batch) for key in ("log_probs", "entropy")}
    weights = torch.linspace(0.5, 1.5, read["log_probs"].numel()).view_as(read["log_probs"]) * batch["response_mask"]
    loss = (read["log_probs"] * weights).sum() - 0.3 * (read["entropy"] * weights).sum()
    loss.backward()
    return {
        "read": {key: value.detach() for key, value in read.items()},
        "all": {key: output[key].values().detach() for key in ("log_probs", "entropy")},
        "grads": {name: p.grad.detach().clone() for name, p in model.named_parameters()},
        "rows": counter.rows,
        "response_tokens": int(batch["response_mask"].sum()),
        "real_tokens": int(batch["attention_mask"].sum()),
    }


def parity_worker(rank, world_size, padding: str, sequence_parallel: bool):
    """verl's unfused BSHD step vs hook mode's, on identical models and batches; plus rows under SFT (every row)."""
    init_model_parallel(world_size)
    results = {}
    for mode in ("verl", "hook"):
        engine, model = bshd_engine(mode, sequence_parallel)
        results[mode] = train_step(engine, model, padding)
        if mode == "hook":
            results["hook_every_row"] = train_step(engine, model, padding, sft_loss_function())
            results["hook_fused_on"] = engine.engine_config.use_fused_kernels
    return results


def context_parallel_worker(rank, world_size, padding: str):
    """verl's unfused BSHD step and hook mode's at CP=world_size (verl's zigzag halves; CPU CP attention)."""
    init_model_parallel(1, cp_size=world_size)
    return {mode: train_step(*bshd_engine(mode), padding) for mode in ("verl", "hook")}


def relative_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    scale = reference.double().abs().max().item()
    return (reference.double() - other.double()).abs().max().item() / max(scale, 1e-30)


def assert_parity(results) -> None:
    verl, hook = results["verl"], results["hook"]
    assert results["hook_fused_on"] is True
    for key in ("log_probs", "entropy"):
        assert relative_error(verl["read"][key], hook["read"][key]) <= RELATIVE, key
    assert verl["grads"].keys() == hook["grads"].keys()
    for name, grad in verl["grads"].items():
        assert grad.abs().max() > 0, name  # every parameter takes part in the loss
        assert relative_error(grad, hook["grads"][name]) <= RELATIVE, name
    # The output weight multiplies exactly the rows verl reads: response predictions, no prompt/padding/last rows.
    assert hook["rows"] == hook["response_tokens"]
    assert int((hook["all"]["log_probs"] != 0).sum()) == hook["response_tokens"]
    # A loss that may read every row (SFT) gets every real row, still no padding row; values agree with verl's.
    every = results["hook_every_row"]
    assert every["rows"] == every["real_tokens"]
    for key in ("log_probs", "entropy"):
        assert relative_error(verl["read"][key], every["read"][key]) <= RELATIVE, key


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def one_process_group():
    """Leave no process group behind: later test modules expect torch.distributed uninitialized."""
    yield
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def clean_verl(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    init_model_parallel(1)
    yield
    os.environ.pop(ENV_VAR, None)
    call_sites.restore()
    call_sites.install_build_gate(transformer_impl)


# ---------------------------------------------------------------- parity with verl's unfused BSHD path


@pytest.mark.parametrize("padding", sorted(PADDINGS))
def test_hook_bshd_matches_verl_unfused_bshd(padding):
    assert_parity(parity_worker(0, 1, padding, False))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["nosp", "sp"])
def test_hook_bshd_matches_verl_unfused_bshd_tp2(sequence_parallel):
    from verl_fused_hook_harness.support.distributed import run_in_processes

    for results in run_in_processes(parity_worker, 2, "both", sequence_parallel):
        assert_parity(results)


def test_hook_bshd_context_parallel_matches_verl_and_cp1():
    """CP=2: hook vs verl on each rank; both vs the CP=1 run (values, and gradients summed over the CP ranks,
    as megatron's data-parallel reduction over DP x CP sums them); the ranks together score the rows verl reads."""
    from verl_fused_hook_harness.support.distributed import run_in_processes

    reference = parity_worker(0, 1, "both", False)["verl"]
    ranks = run_in_processes(context_parallel_worker, 2, "both")
    for result in ranks:
        for key in ("log_probs", "entropy"):
            assert relative_error(result["verl"]["read"][key], result["hook"]["read"][key]) <= RELATIVE, key
            assert relative_error(reference["read"][key], result["hook"]["read"][key]) <= RELATIVE, key
    for name, grad in reference["grads"].items():
        for mode in ("verl", "hook"):
            summed = sum(result[mode]["grads"][name] for result in ranks)
            assert relative_error(grad, summed) <= RELATIVE, (mode, name)
    assert sum(result["hook"]["rows"] for result in ranks) == reference["response_tokens"]


def test_mixed_temperatures_matter_and_match_uniform_runs():
    from verl.workers.utils.padding import no_padding_2_padding

    engine, model = bshd_engine("hook")
    with torch.no_grad():
        mixed = forward_step(engine, model, padded_rl_batch("both"))
        for index, temperature in enumerate(TEMPERATURES):
            batch = padded_rl_batch("both", temperatures=(temperature,) * 3)
            uniform = forward_step(engine, model, batch)
            for key in ("log_probs", "entropy"):
                torch.testing.assert_close(
                    no_padding_2_padding(mixed[key], batch)[index],
                    no_padding_2_padding(uniform[key], batch)[index],
                    rtol=0,
                    atol=1e-6,
                )
        at_one = forward_step(engine, model, padded_rl_batch("both", temperatures=(1.0,) * 3))
    assert not torch.allclose(mixed["log_probs"][0], at_one["log_probs"][0])


def test_forced_max_seqlen_pads_wider_and_changes_nothing():
    from verl.utils import tensordict_utils as tu

    engine, model = bshd_engine("hook")
    with torch.no_grad():
        plain = forward_step(engine, model, padded_rl_batch("both"))
        batch = padded_rl_batch("both")
        tu.assign_non_tensor(batch, forced_max_seqlen=23)
        counter = OutputWeightRows(model.config.hidden_size, VOCAB)
        with counter:
            widened = forward_step(engine, model, batch)
    assert counter.rows == int(batch["response_mask"].sum())
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(widened[key].values(), plain[key].values(), rtol=0, atol=1e-6)


def test_thd_engine_still_takes_the_thd_forward():
    """The same model on a use_remove_padding=True engine: verl's packed layout, unchanged by this feature."""
    from verl.workers.utils.padding import no_padding_2_padding

    os.environ[ENV_VAR] = "1"
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=VOCAB, seed=7)
    engine = megatron_engine([model], fused_kernel_options={"output_processor_backend": "torch"})
    engine._maybe_enable_fused_kernels()
    bshd, bshd_model = bshd_engine("hook")
    batch = padded_rl_batch("both")
    with torch.no_grad():
        packed = forward_step(engine, model, batch)
        padded = forward_step(bshd, bshd_model, padded_rl_batch("both"))
    torch.testing.assert_close(
        no_padding_2_padding(packed["log_probs"], batch),
        no_padding_2_padding(padded["log_probs"], batch),
        rtol=0,
        atol=1e-5,
    )


def test_bshd_forward_refuses_thd_only_inputs():
    from verl_fused_hook.verl_integration.engine_forward import make_engine_forward
    from verl_fused_hook.verl_integration.forward_step import HookStep
    from verl_fused_hook.verl_integration.layouts import BSHD

    engine, model = bshd_engine("hook")
    forward = make_engine_forward(vision_model=False)
    input_ids = padded_rl_batch("both")["input_ids"]
    padded = HookStep(layout=BSHD)
    with pytest.raises(ValueError, match="pad_to_length_bucket: .*use_remove_padding=True"):
        forward(model, input_ids, input_ids.clone(), {}, 1.0, True, 0, pad_to_length_bucket=64, step=padded)
    with pytest.raises(ValueError, match="local_cp_size: "):
        forward(model, input_ids, input_ids.clone(), {}, 1.0, True, 0, local_cp_size=2, step=padded)


# ---------------------------------------------------------------- the build step (verl's real
# _maybe_enable_fused_kernels)


def test_hook_mode_keeps_fused_kernels_on_without_remove_padding(caplog):
    caplog.set_level(logging.INFO, logger="verl_fused_hook")
    engine, model = bshd_engine("hook")
    assert engine.engine_config.use_fused_kernels is True
    assert model._verl_fused_hook_plan.mode == "hook" and model._verl_fused_forward_mode == "hook"
    assert "forward" not in model.__dict__  # the hook path, not verl's monkey patch
    assert "fused kernels kept on with use_remove_padding=False (verl would turn them off)" in caplog.text


def test_switch_unset_verl_still_turns_fused_kernels_off(caplog):
    caplog.set_level(logging.INFO)
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=VOCAB, seed=7)
    engine = megatron_engine([model], use_remove_padding=False)
    engine._maybe_enable_fused_kernels()
    assert engine.engine_config.use_fused_kernels is False
    assert not hasattr(model, "_verl_fused_hook_plan") and not hasattr(model, "_verl_fused_forward_mode")
    assert model_forward_fused.patch_fused_forward is call_sites.original(model_forward_fused, "patch_fused_forward")
    assert "Fused kernels require remove-padding" in caplog.text


def test_legacy_mode_keeps_verl_refusal(caplog):
    os.environ[ENV_VAR] = "0"
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=VOCAB, seed=7)
    engine = megatron_engine([model], use_remove_padding=False)
    engine._maybe_enable_fused_kernels()
    assert engine.engine_config.use_fused_kernels is False and not hasattr(model, "_verl_fused_hook_plan")
    assert "verl turned fused kernels off for this engine (use_remove_padding=False)" in caplog.text


def test_value_model_without_remove_padding_stays_as_verl_does_it(caplog):
    os.environ[ENV_VAR] = "1"
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=VOCAB, seed=7)
    engine = megatron_engine([model], use_remove_padding=False)
    engine.is_value_model = True
    engine._maybe_enable_fused_kernels()
    assert engine.engine_config.use_fused_kernels is False and not hasattr(model, "_verl_fused_hook_plan")
    assert "verl turned fused kernels off for this engine (use_remove_padding=False, value model)" in caplog.text


def test_disabling_reasons_follow_verl_and_hook_mode_lifts_padding_or_mtp_not_both():
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=VOCAB, seed=7)
    engine = megatron_engine([model], use_remove_padding=False, mtp_enable=True)
    reasons = call_sites.verl_disabling_reasons(engine)
    assert reasons == ["use_remove_padding=False", "mtp.enable=True"]
    assert call_sites.verl_disabling_reasons(megatron_engine([model])) == []
    # MTP's fused loss runs on packed batches: with the padded layout too, verl's MTP disable stands
    assert call_sites.reasons_hook_mode_lifts(reasons) == {"use_remove_padding=False"}
    assert call_sites.reasons_hook_mode_lifts(["mtp.enable=True"]) == {"mtp.enable=True"}


# ---------------------------------------------------------------- the CPU stand-in attention


def _padded_vs_separate(mask_rows):
    """Model logits for a [b, s] padded batch (True = real) vs each sample's real tokens run alone."""
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=96, seed=3)
    generator = torch.Generator().manual_seed(5)
    mask = torch.tensor(mask_rows, dtype=torch.bool)
    input_ids = torch.randint(0, 96, mask.shape, generator=generator)
    position_ids = (mask.long().cumsum(dim=1) - 1).clamp_min(0)
    padded = model(input_ids, position_ids, mask)
    errors = []
    for i in range(mask.shape[0]):
        real = input_ids[i][mask[i]][None]
        alone = model(real, torch.arange(real.shape[1])[None], None)
        errors.append((padded[i][mask[i]] - alone[0]).abs().max().item())
    return max(errors), padded


def test_stand_in_attention_right_and_left_padding():
    error, _ = _padded_vs_separate([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1], [1, 1, 0, 0, 0, 0, 0]])
    assert error <= 1e-5
    error, _ = _padded_vs_separate([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1]])
    assert error <= 1e-5


def test_stand_in_attention_split_mask_uses_an_explicit_mask():
    # Real tokens in two runs (as a context-parallel rank's zigzag halves hold them): causal over the real keys only.
    from verl_fused_hook_harness.stand_ins.bshd_attention import PaddedDotProductAttention

    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=96, seed=3)
    attention = model.decoder.layers[0].self_attention.core_attention
    assert isinstance(attention, PaddedDotProductAttention)
    generator = torch.Generator().manual_seed(1)
    seq, heads, groups, dim = 6, 4, 2, 16
    query = torch.randn(seq, 1, heads, dim, generator=generator)
    key, value = (torch.randn(seq, 1, groups, dim, generator=generator) for _ in range(2))
    mask = torch.tensor([[1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    out = attention(query, key, value, mask).view(seq, heads, dim)
    real = mask[0].nonzero().flatten()
    q, k, v = query[real, 0], key[real, 0], value[real, 0]  # the real tokens as one sequence
    k, v = k.repeat_interleave(heads // groups, dim=1), v.repeat_interleave(heads // groups, dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=attention.softmax_scale
    ).transpose(0, 1)
    torch.testing.assert_close(out[real], expected, rtol=0, atol=1e-6)
    assert bool((out[~mask[0]] == 0).all())


# ---------------------------------------------------------------- the A/B command's BSHD scenario


def test_ab_parity_bshd_layout_runs_as_users_run_it(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    path = tmp_path / "ab_bshd.json"
    scenarios = "tp1/nosp/tied,tp2/nosp/untied,tp2/sp/untied"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_fused_hook_harness.cli",
            "ab-parity",
            "--device",
            "cpu",
            "--layout",
            "bshd",
            "--scenarios",
            scenarios,
            "--json",
            str(path),
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(path.read_text())
    assert report["layout"] == "bshd" and report["match"] is True
    assert {entry["scenario"]["name"] for entry in report["scenarios"]} == set(scenarios.split(","))
    for entry in report["scenarios"]:
        assert entry["modes_resolved"] == {
            "legacy": "unfused",
            "hook": "hook",
        }  # verl turned fused off; hook kept it on
        for tensor in ("log_probs", "entropy", "policy_loss", "grads"):
            assert entry["vs_unfused_rel"]["hook"][tensor] <= 1e-5, (entry["scenario"]["name"], tensor)
    assert "fused kernels kept on with use_remove_padding=False" in done.stderr + done.stdout
    assert "PASS: BSHD hook mode (fused kernels kept on) within 0.0001 of verl's unfused BSHD forward" in done.stdout


def test_ab_bshd_evaluation_flags_mismatches():
    from verl_fused_hook_harness.commands.ab import parity as ab_parity
    from verl_fused_hook_harness.commands.ab.bshd import evaluate_bshd

    base = {
        "log_probs": torch.full((4,), -3.0),
        "entropy": torch.full((4,), 2.0),
        "policy_loss": torch.ones(1),
        "grads": {"w": torch.full((3,), 2.0)},
        "peak_bytes": 1,
    }
    name = "tp1/nosp/untied"
    scenario = ab_parity.Scenario(1, False, False)

    def runs(hook_mode, grad_shift):
        hook = {**base, "mode": hook_mode, "grads": {"w": base["grads"]["w"] + grad_shift}}
        return {"legacy": [{name: {**base, "mode": "unfused"}}], "hook": [{name: hook}]}

    assert evaluate_bshd(scenario, runs("hook", 1e-5), rtol=1e-4)["match"] is True
    assert evaluate_bshd(scenario, runs("hook", 1e-3), rtol=1e-4)["match"] is False  # 5e-4 relative
    assert evaluate_bshd(scenario, runs("unfused", 0.0), rtol=1e-4)["match"] is False  # hook mode did not stay fused


def test_e2e_bench_bshd_layout_on_the_cpu(tmp_path):
    """The benchmark's padded flow (timings on the CPU mean nothing): modes resolve as built, parity with verl holds."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    config = root / "verl_fused_hook_harness" / "configs" / "tiny_qwen2"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "verl_fused_hook_harness.cli",
            "e2e-bench",
            "--device",
            "cpu",
            "--hf-config",
            str(config),
            "--layout",
            "bshd",
            "--sizes",
            "256",
            "--warmups",
            "1",
            "--repeats",
            "1",
            "--out",
            str(tmp_path),
        ],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "e2e.json").read_text())
    (size,) = report["sizes"]
    assert report["layout"] == "bshd" and size["padded_tokens"] > size["tokens"]
    rows = {row["mode"]: row for row in size["modes"]}
    assert {name: row["resolved"] for name, row in rows.items()} == {
        "verl-unfused": "unfused",
        "hook+verl": "hook",
        "hook+ours+mask": "hook",
    }
    for name in ("hook+verl", "hook+ours+mask"):
        parity = rows[name]["vs_verl_unfused"]
        assert parity["log_probs"] <= 1e-5 and parity["entropy"] <= 1e-5 and parity["grads_rel"] <= 1e-5, (name, parity)
    assert "padded" in (tmp_path / "e2e.md").read_text()


def test_mtp_on_the_padded_layout_keeps_verls_refusal_in_hook_mode(caplog):
    """The fused MTP loss takes verl's packed MTP inputs: MTP together with use_remove_padding=False is left to verl."""
    os.environ[ENV_VAR] = "1"
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=VOCAB, seed=7)
    engine = megatron_engine([model], use_remove_padding=False, mtp_enable=True)
    engine._maybe_enable_fused_kernels()
    assert engine.engine_config.use_fused_kernels is False and not hasattr(model, "_verl_fused_hook_plan")
    assert "verl turned fused kernels off for this engine (use_remove_padding=False, mtp.enable=True)" in caplog.text
