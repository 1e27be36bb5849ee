"""The parity runs' determinism switch (verl_fused_hook_harness.support.determinism) on a real tiny GPTModel, CPU."""

from __future__ import annotations

import os

import torch

from verl_fused_hook_harness.support.determinism import (
    CUBLAS_WORKSPACE_VARIABLE,
    deterministic_steps,
    prepare_cublas_workspace,
)
from verl_fused_hook_harness.support.distributed import run_in_processes


def switch_worker(rank, world_size):
    from verl_fused_hook_harness.stand_ins.megatron_cpu import (
        build_cpu_gpt,
        init_model_parallel,
        tiny_transformer_config,
    )

    init_model_parallel(1)
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=128)
    embedding = model.embedding.word_embeddings
    # A fake for Transformer Engine's attention (TE cannot run here): a module holding the field TE's
    # DotProductAttention and its backends fix at build and read at every forward.
    te_attention = model.decoder.layers[0].self_attention.core_attention
    te_attention.deterministic = False
    seen = {"before": (embedding.deterministic_mode, torch.are_deterministic_algorithms_enabled())}
    try:
        with deterministic_steps(model):
            pass
    except RuntimeError as error:
        seen["unset_workspace_error"] = str(error)
    prepare_cublas_workspace()
    tokens = torch.arange(8)[None]
    grads = []
    with deterministic_steps(model):
        seen["te_left"] = te_attention.deterministic  # switched only where asked: small packed batches
    for _ in range(2):
        with deterministic_steps(model, te_attention=True):
            seen["inside"] = (
                embedding.deterministic_mode,
                torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
            )
            seen["te_inside"] = te_attention.deterministic
            model.zero_grad(set_to_none=True)
            model(tokens, tokens, None).sum().backward()
            grads.append(embedding.weight.grad.clone())
    seen["after"] = (embedding.deterministic_mode, torch.are_deterministic_algorithms_enabled())
    seen["te_after"] = te_attention.deterministic
    seen["repeatable"] = torch.equal(grads[0], grads[1]) and grads[0].abs().sum().item() > 0
    return seen


def test_switches_torch_megatron_and_te_attention_on_and_restores_them():
    env = {CUBLAS_WORKSPACE_VARIABLE: ""}
    seen = run_in_processes(switch_worker, 1, env=env)[0]
    assert seen["before"] == (False, False)
    assert CUBLAS_WORKSPACE_VARIABLE in seen["unset_workspace_error"]
    assert seen["inside"] == (True, True, False)  # warn_only off: attention backwards are deterministic only then
    assert seen["after"] == (False, False)
    assert seen["te_left"] is False  # TE's attention as built unless asked
    assert seen["te_inside"] is True and seen["te_after"] is False  # TE's attention: its deterministic backend inside
    assert seen["repeatable"]


def test_keeps_a_workspace_setting_the_user_chose(monkeypatch):
    monkeypatch.setenv(CUBLAS_WORKSPACE_VARIABLE, ":16:8")
    prepare_cublas_workspace()
    assert os.environ[CUBLAS_WORKSPACE_VARIABLE] == ":16:8"
