"""Run megatron-core GPTModels on the CPU (tests and the CPU A/B demo only).

megatron-core assumes a CUDA device in three places (see shared FACTS), and its MoE layer in one more (moe_cpu.py):
`torch.cuda.current_device()` is called unconditionally, the CUDA RNG tracker is
forked by attention and seeded at start-up, and the local spec's torch norm
refuses sequence parallelism; under context parallelism RoPE's per-rank slice
also copies through CUDA, and activation recompute (`tensor_parallel.checkpoint`)
saves and restores the CUDA generator's state. `enable_cpu_megatron()` works
around all five (on the CPU the CPU generator and the tracker hold every RNG
state); nothing here is used by the product at training time.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from ..support.upstream_notices import unprinted_gloo_connections
from .bshd_attention import PaddedDotProductAttention
from .moe_cpu import enable_cpu_moe


def _cpu_device() -> str:
    return "cpu"


def _no_cuda_rng_state(*args, **kwargs) -> torch.Tensor:
    """megatron's `_get_cuda_rng_state` on the CPU: there is no CUDA generator (the CPU one is saved apart)."""
    return torch.empty(0, dtype=torch.uint8)


def _keep_cpu_rng_state(*args, **kwargs) -> None:
    """megatron's `_set_cuda_rng_state` on the CPU: nothing to restore."""


class CpuRNGStatesTracker(megatron_random.CudaRNGStatesTracker):
    """Megatron's RNG tracker with CPU generator states in place of CUDA ones."""

    def add(self, name, seed):
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"rng state {name!r} or seed {seed} already added")
        self._is_initialized = True
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name=megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise ValueError(f"rng state {name!r} was never added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _cpu_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
    """megatron's `get_pos_emb_on_this_cp_rank` (the rank's zigzag chunks r and 2*cp-1-r) without its pinned
    memory and `.cuda()` copy, which need a CUDA device."""
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    index = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1 :])
    pos_emb = pos_emb.index_select(seq_dim, index)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2 :])


def enable_cpu_megatron() -> None:
    """Idempotently apply the CPU workarounds for megatron-core (process-wide)."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = _cpu_device
        rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank  # context parallelism
        megatron_random._get_cuda_rng_state = _no_cuda_rng_state  # activation recompute
        megatron_random._set_cuda_rng_state = _keep_cpu_rng_state
        enable_cpu_moe()
    if not isinstance(megatron_random._CUDA_RNG_STATE_TRACKER, CpuRNGStatesTracker):
        megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
        megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def seed_model_parallel_rng(seed: int) -> None:
    """CPU counterpart of megatron's model_parallel_cuda_manual_seed (same tracker names)."""
    tracker = megatron_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    torch.manual_seed(seed)
    tracker.add(megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(megatron_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + 100 * ep_rank + tp_rank + 1)


def init_model_parallel(
    tp_size: int = 1,
    seed: int = 1234,
    cp_size: int = 1,
    *,
    pp_size: int = 1,
    vpp_size: int | None = None,
    ep_size: int = 1,
) -> None:
    """Set up megatron's parallel state on an already initialized gloo group (or a one-process one)."""
    enable_cpu_megatron()
    with unprinted_gloo_connections():
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp_size,
            context_parallel_size=cp_size,
            pipeline_model_parallel_size=pp_size,
            virtual_pipeline_model_parallel_size=vpp_size,
            expert_model_parallel_size=ep_size,
        )
    seed_model_parallel_rng(seed)


class CpuNorm:
    """torch LayerNorm/RMSNorm that, unlike the local spec's, accepts sequence parallelism:
    its parameters are marked `sequence_parallel` as Megatron's own norms mark them."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(hidden_size, eps=eps, dtype=config.params_dtype)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def cpu_layer_spec(config: TransformerConfig):
    """Local layer spec with CPU-ready norms and a core attention that takes THD and padded (BSHD) batches
    (megatron's MoE layer with sequential experts when the config has experts)."""
    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, normalization=config.normalization, qk_layernorm=config.qk_layernorm
    )
    spec.submodules.input_layernorm = CpuNorm
    spec.submodules.pre_mlp_layernorm = CpuNorm
    spec.submodules.self_attention.submodules.core_attention = PaddedDotProductAttention
    if config.qk_layernorm:
        spec.submodules.self_attention.submodules.q_layernorm = CpuNorm
        spec.submodules.self_attention.submodules.k_layernorm = CpuNorm
    return spec


def cpu_block_spec(config: TransformerConfig, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The layers of this pipeline stage (model chunk `vp_stage` under virtual pipelining); all without PP."""
    layer = cpu_layer_spec(config)
    layers = get_num_layers_to_build(config, vp_stage) if config.pipeline_model_parallel_size > 1 else config.num_layers
    return TransformerBlockSubmodules(layer_specs=[layer] * layers, layer_norm=CpuNorm)


def cpu_mtp_block_spec(config: TransformerConfig, vp_stage: int | None = None):
    """The MTP block spec for `config.mtp_num_layers` layers with CPU-ready norms (None without MTP, and on
    pipeline stages that hold no MTP layer)."""
    if not config.mtp_num_layers:
        return None
    spec = get_gpt_mtp_block_spec(config, cpu_layer_spec(config), use_transformer_engine=False, vp_stage=vp_stage)
    if spec is None:
        return None
    for layer in spec.layer_specs:
        layer.submodules.enorm = CpuNorm
        layer.submodules.hnorm = CpuNorm
        layer.submodules.layer_norm = CpuNorm
    return spec


def tiny_transformer_config(
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_attention_heads: int = 4,
    num_query_groups: int | None = 2,
    sequence_parallel: bool = False,
    use_mup: bool = False,
    mtp_num_layers: int | None = None,
    params_dtype: torch.dtype = torch.float32,
) -> TransformerConfig:
    """A small Qwen2-like config (RMSNorm, SwiGLU, GQA, RoPE) for CPU tests."""
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    cp_size = parallel_state.get_context_parallel_world_size()
    extra = {"use_mup": True, "mup_output_mult": 0.37} if use_mup else {}
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden_size,
        ffn_hidden_size=hidden_size * 2,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp_size,
        context_parallel_size=cp_size,
        sequence_parallel=sequence_parallel and tp_size > 1,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        mtp_num_layers=mtp_num_layers,
        **extra,
    )


def build_cpu_gpt(
    config: TransformerConfig,
    *,
    vocab_size: int,
    max_sequence_length: int = 256,
    tied: bool = False,
    pre_process: bool = True,
    post_process: bool = True,
    seed: int = 1234,
) -> GPTModel:
    """A GPTModel with the CPU layer spec (and MTP block when `config.mtp_num_layers`), seeded."""
    torch.manual_seed(seed)
    return GPTModel(
        config=config,
        transformer_layer_spec=cpu_block_spec(config),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
        mtp_block_spec=cpu_mtp_block_spec(config),
    )
