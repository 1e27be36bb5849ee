"""Weights that do not depend on the pipeline or expert layout: every parameter drawn from its global name.

Why: a pipeline bug (a stage handed the hidden states of another micro-batch, or
rows out of order) hits verl's unfused path and hook mode alike, so comparing the
two cannot see it. Only a run without the pipeline can: the same model split over
PP stages, virtual chunks or EP ranks must give the numbers of one unsplit model.
So each parameter is drawn from a generator seeded by (seed, its name with the
global layer and expert index, and its TP shard when it is TP-sharded): layer 3
has the same weights whether it sits on stage 1 of PP=2 or in a PP=1 model.
Layouts with the same TP size then hold the same model.
"""

from __future__ import annotations

import re
import zlib

import torch

INIT_STD = 0.02
LAYER = re.compile(r"^(.*?\blayers\.)(\d+)(\..*)$")
EXPERT = re.compile(r"^(.*\blocal_experts\.)(\d+)(\..*)$")


TIED = "embedding.word_embeddings.weight"


def global_name(name: str, layer_offset: int, expert_offset: int, tied: bool = False) -> str:
    """`name` with its decoder layer and local expert indices made global (MTP layers keep theirs); with tied
    embeddings the last stage's copy of the embedding (`output_layer.weight`) is the embedding."""
    if tied and name == "output_layer.weight":
        return TIED
    if not name.startswith("mtp."):
        match = LAYER.match(name)
        if match:
            name = f"{match[1]}{int(match[2]) + layer_offset}{match[3]}"
    match = EXPERT.match(name)
    if match:
        name = f"{match[1]}{int(match[2]) + expert_offset}{match[3]}"
    return name


def _shard_rank(name: str, param) -> int | None:
    """The TP rank whose shard `param` is (expert TP for experts), None when it is replicated."""
    from megatron.core import parallel_state

    if not getattr(param, "tensor_model_parallel", False):
        return None
    if ".experts." in name:
        return parallel_state.get_expert_tensor_parallel_rank()
    return parallel_state.get_tensor_model_parallel_rank()


def set_layout_independent_weights(model, seed: int, vp_stage: int | None) -> None:
    """Overwrite every parameter of one model chunk (a GPTModel, before DDP wraps it) from its global name."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = model.config
    layer_offset = get_transformer_layer_offset(config, vp_stage)
    local_experts = (config.num_moe_experts or 0) // parallel_state.get_expert_model_parallel_world_size()
    expert_offset = parallel_state.get_expert_model_parallel_rank() * local_experts
    with torch.no_grad():
        for name, param in model.named_parameters():
            tied = model.share_embeddings_and_output_weights
            key = f"{seed}/{global_name(name, layer_offset, expert_offset, tied)}/{_shard_rank(name, param)}"
            generator = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if param.dim() == 1 and name.endswith("weight"):  # norms: near one
                values = 1.0 + 0.1 * values
            else:
                values = INIT_STD * values
            param.copy_(values.to(param.dtype))
