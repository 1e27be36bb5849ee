"""A released verl Megatron engine must not be kept alive by the plugin (issue 22: train-parity's released engines).

Each setup runs in a fresh process (this file run as a script), on the CPU with the tiny Qwen2 config: verl's
real `MegatronEngineWithLMHead` built as train-parity builds it (`support/train_engine.build_engine`: actor with
DDP, distributed optimizer and AdamW; forward-only reference), one GRPO step (old and reference log-probs, the
actor update through `train_batch`), then a release, in rounds:

- "verl": what train-parity's `_release` does (engine.module/optimizer/lr_scheduler/checkpoint manager = None,
  gc.collect()), measured while the engines are still referenced (as in `_run_steps`) and after they are dropped
  and collected; fp32 (the CPU default) and bf16 (the GPU default);
- "recipe": `support.train_engine.release_engines` (train-parity's release), which also clears what verl's
`register_megatron_training_hooks` put on
  the model's TransformerConfig (`grad_scale_func` = the optimizer's bound `scale_loss`, ...);
- hook setup only, "recipe+leak": the recipe with a plugin-like global injected (`call_sites.set_plan` also
  appends each model to a module-level list): proof that the comparison below catches a plugin reference.

What survives is read from weakrefs (engines, DDP, GPTModel, a parameter, optimizer, AdamW, reference model) and
from the storages of the tensors that appeared during the build and step (`StorageWeakRef`: freed or not).

Setups: "absent" (no switch, VERL_USE_EXTERNAL_PLUGINS=none, no install(): not one verl_fused_hook module is
imported), "hook" (VERL_FUSED_USE_OP_HOOK=1, plugin defaults), "fused" (=1 with output_processor_fused_loss);
`python tests/test_engine_release.py installed|legacy` measures the plugin installed with the switch unset, and
=0. Each worker first runs one unmeasured round (lazy imports, first-use caches).
Measured (docs/benchmarks.md): after verl's release alone the fp32 actor survives in every setup alike (upstream:
megatron's fp32 optimizer shards are autograd views of the parameters, which hides DDP's grad-accumulator hooks
from the collector), the bf16 actor survives while the engine object is referenced; the recipe frees both.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SWITCH = "VERL_FUSED_USE_OP_HOOK"
MARK = "ENGINE-RELEASE "
# setup: (VERL_FUSED_USE_OP_HOOK or None for unset, fused_kernel_options); the tests run the first three,
# `python tests/test_engine_release.py SETUP` prints any one's measurement as JSON.
SETUPS = {
    "absent": (None, {}),  # plugin never imported
    "hook": ("1", {}),  # the plugin's defaults
    "fused": ("1", {"output_processor_fused_loss": True}),
}
MORE_SETUPS = {"installed": (None, {}), "legacy": ("0", {})}  # plugin installed with the switch unset; legacy
ROUNDS = (("float32", "verl"), ("float32", "recipe"), ("bfloat16", "verl"), ("bfloat16", "recipe"))
LEAK_ROUND = ("float32", "recipe+leak")


def verl_release(*engines) -> None:
    """What train-parity's release did before release_engines: drop the engine's attributes, collect."""
    for engine in engines:
        engine.module = engine.optimizer = engine.lr_scheduler = None
        engine.checkpoint_mananager = None  # sic: verl's spelling
    gc.collect()


# ---------------------------------------------------------------- the worker (a fresh process per setup)


def _torch_linear_cross_entropy(hidden, weight, labels, temperature, reduction="none", tp_group=None):
    """verl's Triton kernel contract (fp32 log-probs and entropy per row) in plain torch, TP=1: verl's own fused
    path needs it on the CPU, and the plugin-absent setup must not import the plugin's op."""
    logits = (hidden.reshape(-1, hidden.shape[-1]).float() @ weight.float().t()) / temperature
    log_p = logits.log_softmax(dim=-1)
    chosen = log_p.gather(-1, labels.reshape(-1, 1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return chosen.reshape(labels.shape), entropy.reshape(labels.shape)


def _storages() -> dict:
    """{storage id: (StorageWeakRef, bytes)} for every tensor the collector can see."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    found = {}
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.is_meta or obj.is_nested:
            continue
        storage = obj.untyped_storage()
        if storage.nbytes() and storage._cdata not in found:
            found[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
    return found


def _unwrap(module):
    while hasattr(module, "module"):
        module = module.module
    return module


def _watch(actor, reference) -> dict:
    import weakref

    ddp = actor.module[0]
    gpt = _unwrap(ddp)
    inner = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])[0]
    objects = dict(actor_engine=actor, actor_ddp=ddp, actor_gpt=gpt, actor_param=next(gpt.parameters()),
                   actor_optimizer=actor.optimizer, actor_adam=inner.optimizer, reference_engine=reference,
                   reference_gpt=_unwrap(reference.module[0]))  # fmt: skip
    return {name: weakref.ref(obj) for name, obj in objects.items()}


def _survivors(watch: dict, new: dict) -> dict:
    """Which watched objects live, and the bytes of this round's storages that live. Megatron's
    `RotaryEmbedding.forward` lru_cache (32 entries: the module and its cos/sin table) is emptied first: an
    upstream cache of bounded size, the same in every setup, that would otherwise make the bytes depend on
    which sequence lengths came last."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    RotaryEmbedding.forward.cache_clear()
    gc.collect()
    return {
        "alive": sorted(name for name, ref in watch.items() if ref() is not None),
        "bytes": sum(n for ref, n in new.values() if not ref.expired()),
    }


def _engines(options: dict, dtype: str):
    from dataclasses import replace

    from verl_fused_hook_harness.support.hf_model import TINY_QWEN2
    from verl_fused_hook_harness.support.train_engine import EngineSetup, build_engine

    setup = EngineSetup(hf_path=str(TINY_QWEN2), tp=1, dtype=dtype, seed=1234, micro_batch_size=5, total_steps=4,
                        lr=1e-4, offload=False, fused_kernel_options=dict(options))  # fmt: skip
    return build_engine(setup), build_engine(replace(setup, offload=False), forward_only=True)


def _train_step(actor, reference) -> float:
    """train_parity.train_step without the plugin's counters: old and reference log-probs, the actor update."""
    import functools

    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from verl_fused_hook_harness.support.grpo_batches import RolloutShape, packed, rollout

    shape = RolloutShape(prompts=2, n=5, prompt_lengths=(3, 9), response_lengths=(2, 10))
    keys = dict(use_remove_padding=True, use_dynamic_bsz=False, micro_batch_size_per_gpu=5, use_fused_kernels=True)
    fields = rollout(shape, actor.model_config.hf_config.vocab_size, 1234, 1)
    for engine, name, entropy in ((actor, "old_log_probs", True), (reference, "ref_log_prob", False)):
        data = packed(fields, 1.0, calculate_entropy=entropy, compute_loss=False, **keys)
        with engine.eval_mode():
            output = engine.infer_batch(data, loss_function=None)
        fields[name] = no_padding_2_padding(output["model_output"]["log_probs"], data).float().cpu()
    config = McoreActorConfig(ppo_mini_batch_size=shape.prompts, ppo_micro_batch_size_per_gpu=5, use_dynamic_bsz=False,
                              entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.001, kl_loss_type="low_var_kl",
                              loss_agg_mode="token-mean", rollout_n=shape.n)  # fmt: skip
    data = packed(fields, 1.0, calculate_entropy=True, global_batch_size=shape.sequences, **keys)
    with actor.train_mode():
        output = actor.train_batch(data, loss_function=functools.partial(ppo_loss, config=config))
    actor.lr_scheduler_step()
    return float(sum(output["loss"]) if isinstance(output["loss"], list) else output["loss"])


def _inject_plugin_global_leak() -> None:
    """A plugin bug on purpose: a module-level registry of every model the plugin gives a plan to."""
    from verl_fused_hook.verl_integration import call_sites, model_plan

    model_plan._leaked_models = []
    set_plan = call_sites.set_plan

    def leaking_set_plan(model, plan):
        model_plan._leaked_models.append(model)
        set_plan(model, plan)

    call_sites.set_plan = leaking_set_plan


def _round(options: dict, dtype: str, release: str) -> dict:
    from verl_fused_hook_harness.stand_ins.cuda_on_cpu import cuda_names_on_cpu

    if release == "recipe+leak":
        _inject_plugin_global_leak()
    gc.collect()
    before = set(_storages())
    with cuda_names_on_cpu():  # as train-parity's mode_context: megatron's optimizer on CPU tensors
        actor, reference = _engines(options, dtype)
        loss = _train_step(actor, reference)
    gc.collect()
    new = {key: value for key, value in _storages().items() if key not in before}
    watch = _watch(actor, reference)
    gpt = watch["actor_gpt"]()
    counts = getattr(gpt, "_verl_fused_hook_counts", None)
    facts = {
        "loss": loss,
        "param_dtype": str(next(gpt.parameters()).dtype),
        "param_bytes": sum(p.numel() * p.element_size() for p in gpt.parameters()),
        "new_bytes": sum(n for _, n in new.values()),
        "hook_forwards": None if counts is None else counts.forwards,
        "fused_loss_forwards": None if counts is None else counts.fused_loss_forwards,
    }
    del gpt, counts
    if release == "verl":
        verl_release(actor, reference)
    else:
        from verl_fused_hook_harness.support.train_engine import release_engines

        release_engines(actor, reference)
    held = _survivors(watch, new)  # the engine objects still referenced, as in train_parity._run_steps
    del actor, reference
    gc.collect()
    return facts | {"held": held, "dropped": _survivors(watch, new)}


def worker(setup: str) -> dict:
    switch, options = (SETUPS | MORE_SETUPS)[setup]
    os.environ.pop(SWITCH, None)
    os.environ["VERL_USE_EXTERNAL_PLUGINS"] = "none"  # `import verl` loads no plugin by itself in any setup
    if switch is not None:
        os.environ[SWITCH] = switch
    if setup != "absent":
        from verl_fused_hook.verl_integration import install

        install()  # what verl's entry point (or train-parity's _prepare_process) does
    import torch
    import verl.models.mcore.model_forward_fused as verl_fused

    from verl_fused_hook_harness.stand_ins.megatron_cpu import init_model_parallel

    torch.set_num_threads(1)
    verl_fused.linear_cross_entropy = _torch_linear_cross_entropy  # looked up at call time by verl's fused path
    init_model_parallel(1, seed=1234)
    _round(options, "float32", "recipe")  # warm-up: lazy imports and first-use caches, not measured
    rounds = ROUNDS + ((LEAK_ROUND,) if setup == "hook" else ())
    results = {f"{dtype}/{release}": _round(options, dtype, release) for dtype, release in rounds}
    plugin = sorted(m for m in sys.modules if m == "verl_fused_hook" or m.startswith("verl_fused_hook."))
    return {"setup": setup, "plugin_modules": plugin, "rounds": results}


# ---------------------------------------------------------------- the tests


def run_worker(setup: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(SWITCH, None)
    done = subprocess.run([sys.executable, __file__, setup], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    assert done.returncode == 0 and lines, f"worker {setup} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(lines[-1][len(MARK) :])


@pytest.fixture(scope="module")
def measured() -> dict:
    return {setup: run_worker(setup) for setup in SETUPS}


def plugin_additions(absent: dict, other: dict) -> list[str]:
    """What survives a release with the plugin on and not with it absent (engine objects, then bytes)."""
    extra = [name for name in other["alive"] if name not in absent["alive"]]
    if other["bytes"] > absent["bytes"]:
        extra.append(f"{other['bytes'] - absent['bytes']} bytes of the engine's tensors")
    return extra


def test_plugin_absent_setup_imports_no_plugin_and_hook_setups_run_it(measured):
    assert measured["absent"]["plugin_modules"] == [], measured["absent"]["plugin_modules"]
    for key, row in measured["absent"]["rounds"].items():
        assert row["hook_forwards"] is None, f"absent/{key}: the plugin's counters are on the model"
    for setup in ("hook", "fused"):
        for key, row in measured[setup]["rounds"].items():
            assert row["hook_forwards"] > 0, f"{setup}/{key}: no engine forward went through the plugin's hook"
            assert (row["fused_loss_forwards"] > 0) == (setup == "fused"), (setup, key, row["fused_loss_forwards"])
    for key in measured["absent"]["rounds"]:
        assert measured["absent"]["rounds"][key]["param_dtype"] == f"torch.{key.split('/')[0]}"


@pytest.mark.parametrize("setup", ["hook", "fused"])
@pytest.mark.parametrize("round_key", [f"{dtype}/{release}" for dtype, release in ROUNDS])
@pytest.mark.parametrize("when", ["held", "dropped"])
def test_plugin_keeps_nothing_of_a_released_engine(measured, setup, round_key, when):
    absent = measured["absent"]["rounds"][round_key][when]
    other = measured[setup]["rounds"][round_key][when]
    extra = plugin_additions(absent, other)
    assert not extra, (
        f"{setup} mode, {round_key} release, engines {when}: {extra} survive that the plugin-absent run frees "
        f"(absent keeps {absent}, {setup} keeps {other}): the plugin holds a reference to a released engine; "
        "look for a module-level cache, registry, contextvar or closure in verl_fused_hook that keeps a model, "
        "optimizer or tensor"
    )


def test_the_comparison_catches_a_plugin_global_that_keeps_models(measured):
    """The check above can fail: with a plugin-like module-level list of models it reports the kept engine."""
    leaked = measured["hook"]["rounds"]["/".join(LEAK_ROUND)]["dropped"]
    clean = measured["absent"]["rounds"]["float32/recipe"]["dropped"]
    extra = plugin_additions(clean, leaked)
    assert "actor_gpt" in extra and any("bytes" in item for item in extra), (clean, leaked)


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("when", ["held", "dropped"])
def test_release_recipe_frees_the_engine(measured, setup, dtype, when):
    """`release_engines` frees the actor and reference at once, even while the engine objects are referenced."""
    row = measured[setup]["rounds"][f"{dtype}/recipe"]
    survivors = row[when]
    engines = {"actor_engine", "reference_engine"} if when == "held" else set()
    assert set(survivors["alive"]) == engines, f"{setup} {dtype}: still alive after release_engines: {survivors}"
    assert survivors["bytes"] <= row["new_bytes"] // 100, (
        f"{setup} {dtype}: {survivors['bytes']} of the {row['new_bytes']} bytes the engines created survive"
    )


def test_verl_release_alone_keeps_the_actor_upstream(measured):
    """The upstream retention release_engine fixes, without the plugin: fp32 keeps the actor after every
    collection; bf16 keeps it while the engine object is referenced (train_parity._run_steps) and frees it once
    the engine is dropped and collected. If this fails, verl or megatron changed: re-measure and update
    docs/benchmarks.md."""
    rounds = measured["absent"]["rounds"]
    actor = {"actor_ddp", "actor_gpt", "actor_param", "actor_optimizer", "actor_adam"}
    assert actor <= set(rounds["float32/verl"]["dropped"]["alive"]), rounds["float32/verl"]
    assert actor <= set(rounds["bfloat16/verl"]["held"]["alive"]), rounds["bfloat16/verl"]
    assert rounds["bfloat16/verl"]["dropped"]["alive"] == [], rounds["bfloat16/verl"]


if __name__ == "__main__":
    print(MARK + json.dumps(worker(sys.argv[1])), flush=True)
