"""verl's `MegatronEngine._build_megatron_module` on megatron-core's local layer spec (train-parity's engines).

STAND-IN, named as such. verl builds the model through Megatron-Bridge or
mbridge (`vanilla_mbridge=True`), both with Transformer Engine's layer spec only
(FACTS), and TE does not build on the CPU or without it. This does what verl's
build step does, with the local spec: verl's own
`verl.utils.megatron_utils.get_model` builds the GPTModel from the engine's
transformer config (through a model provider), sets the TP attributes, wraps it
in `Float16Module` for bf16 and in Megatron's DDP with verl's DDP overrides
(`_resolve_override_ddp_config`). The weights are random from a seed (verl would
load a checkpoint: there is none for a random model). `--layer-spec te` builds
through verl's and mbridge's own code instead (support/train_engine.py).
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from ..support.hf_model import padded_vocab_size, rope_base
from ..support.layout_weights import set_layout_independent_weights
from .megatron_cpu import cpu_block_spec, cpu_mtp_block_spec


def local_spec_provider(engine, seed: int, layout_independent: bool = False):
    """The provider verl's `get_model` calls: a GPTModel on the engine's config with a CPU-capable local spec.

    layout_independent: weights drawn per global parameter name (support/layout_weights.py), so that every
    pipeline and expert layout of one TP size holds the same model."""
    hf_config = engine.model_config.hf_config
    config = engine.tf_config

    def provider(pre_process=True, post_process=True, vp_stage=None):
        spec, mtp_spec = cpu_block_spec(config, vp_stage), cpu_mtp_block_spec(config, vp_stage)
        # identical weights in every mode and process of one parallel layout (each model chunk its own seed)
        torch.manual_seed(seed + 1000 * (vp_stage or 0))
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab_size(hf_config.vocab_size, parallel_state.get_tensor_model_parallel_world_size()),
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            position_embedding_type="rope",
            rotary_base=rope_base(hf_config),
            share_embeddings_and_output_weights=engine.share_embeddings_and_output_weights,
            mtp_block_spec=mtp_spec,
            vp_stage=vp_stage,
        )
        if layout_independent:
            set_layout_independent_weights(model, seed, vp_stage)
        return model

    return provider


def build_on_local_spec(engine, seed: int, layout_independent: bool = False):
    """What `engine._build_megatron_module()` returns, built through verl's `get_model` on the local spec."""
    from verl.utils.megatron_utils import get_model  # verl (and TE's spec) load where an engine is built

    return get_model(
        local_spec_provider(engine, seed, layout_independent),
        wrap_with_ddp=not engine.engine_config.forward_only,
        use_distributed_optimizer=engine.engine_config.use_distributed_optimizer,
        override_ddp_config=engine._resolve_override_ddp_config(),
        transformer_config=engine.tf_config,
    )


def use_local_spec_build(engine, seed: int, layout_independent: bool = False) -> None:
    """Give `engine` (before its `initialize()`) the local-spec model build in place of verl's mbridge build."""
    engine._build_megatron_module = lambda: build_on_local_spec(engine, seed, layout_independent)
