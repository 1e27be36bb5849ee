"""A megatron-core GPTModel from a Hugging Face config file, through mbridge's config conversion.

Why: the A/B script and the integration tests must build the model verl would
build for a real checkpoint's config (mbridge maps the HF fields to a
TransformerConfig), with random weights from a fixed seed so that separate
processes hold identical weights. The layers are the spec the command resolved
(support/layer_spec.py): Transformer Engine's, from mbridge's own spec function
(what its model provider calls), or the CPU-capable local spec (FACTS: the local
attention refuses THD batches, so it gets one that honours `cu_seqlens`).
megatron-core, mbridge and transformers load on first use, so the commands
importing this module answer `--help` at once.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .layer_spec import BUILT_SPECS, LOCAL, TE

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TINY_QWEN2 = CONFIGS / "tiny_qwen2"
QWEN_7B_2LAYER = CONFIGS / "qwen2_5_7b_2layer"
QWEN2_5_0_5B = CONFIGS / "qwen2_5_0_5b"
VOCAB_MULTIPLE = 128  # Megatron pads the vocabulary to a multiple of this times the TP size
QWEN3_30B_A3B_2LAYER = CONFIGS / "qwen3_30b_a3b_2layer"
# MoE models on the local spec: its experts are sequential (grouped GEMM needs Transformer Engine or the grouped_gemm
# package, which mbridge's MoE conversions ask for), and no torch.compile'd fusions (on the CPU dynamo recompiles
# them for every new micro-batch length: minutes per run, same numbers).
LOCAL_SPEC_MOE_OVERRIDES = {"moe_grouped_gemm": False, "bias_activation_fusion": False, "bias_dropout_fusion": False}


def local_spec_overrides(hf_config) -> dict:
    """What megatron-core's local layer spec needs on top of mbridge's conversion of `hf_config` (MoE models)."""
    return dict(LOCAL_SPEC_MOE_OVERRIDES) if getattr(hf_config, "num_experts", None) else {}


def config_folder(path: str | Path) -> str:
    """The folder of an HF config given as a config.json or a folder; ValueError when it does not exist."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} does not exist; pass a config.json or a folder holding one")
    return str(path.parent if path.is_file() else path)


def load_hf_config(path: str | Path = TINY_QWEN2):
    """A transformers config from a config.json file or a folder holding one."""
    from transformers import AutoConfig

    try:
        folder = config_folder(path)
    except ValueError as error:
        raise ValueError(f"hf config: {error}") from None
    return AutoConfig.from_pretrained(folder)


def rope_base(hf_config) -> float:
    rope = getattr(hf_config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    multiple = VOCAB_MULTIPLE * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def build_gpt_from_hf(
    hf_config,
    *,
    sequence_parallel: bool = False,
    tied: bool | None = None,
    seed: int = 1234,
    dtype: torch.dtype = torch.float32,
    layer_spec: str = LOCAL,
    cpu_initialization: bool = True,
    mtp_num_layers: int | None = None,
    transformer_overrides: dict | None = None,
) -> torch.nn.Module:
    """GPTModel for `hf_config` on the current model-parallel state, weights from `seed`.

    tied: override the config's tie_word_embeddings (None keeps it).
    layer_spec: "te" (Transformer Engine's spec: mbridge's `_get_transformer_layer_spec`, as its provider builds it)
        or "local" (the CPU-capable local spec), as resolved by the command (support/layer_spec.py).
    cpu_initialization: True (default) initializes each full weight on the CPU and splits it per rank, so
        every process and every TP size holds identical weights; False initializes in place on the current
        device (megatron's default, much faster for large models; identical weights only for one TP size).
    mtp_num_layers: that many MTP layers (megatron-core's MTP block after the decoder); None keeps mbridge's.
    transformer_overrides: TransformerConfig fields set on top of mbridge's conversion (e.g. recompute).
    """
    from mbridge import AutoBridge
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    from ..stand_ins.megatron_cpu import cpu_block_spec, cpu_mtp_block_spec

    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    share = bool(getattr(hf_config, "tie_word_embeddings", False)) if tied is None else tied
    if layer_spec not in BUILT_SPECS:
        raise ValueError(f"layer_spec={layer_spec!r}: allowed {', '.join(BUILT_SPECS)} (resolve auto first)")
    use_transformer_engine = layer_spec == TE
    bridge = AutoBridge.from_config(hf_config, dtype=dtype)
    bridge.set_extra_args(
        use_cpu_initialization=cpu_initialization,  # True: one full weight, split per rank
        sequence_parallel=sequence_parallel and tp_size > 1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        **{**({} if use_transformer_engine else local_spec_overrides(hf_config)), **(transformer_overrides or {})},
    )
    config = bridge.config
    if mtp_num_layers is not None:
        config.mtp_num_layers = mtp_num_layers or None
    spec = bridge._get_transformer_layer_spec() if use_transformer_engine else cpu_block_spec(config)
    if not config.mtp_num_layers:
        mtp_spec = None
    elif use_transformer_engine:
        mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=True)
    else:
        mtp_spec = cpu_mtp_block_spec(config)
    torch.manual_seed(seed)
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(hf_config.vocab_size, tp_size),
        max_sequence_length=hf_config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_base(hf_config),
        share_embeddings_and_output_weights=share,
        mtp_block_spec=mtp_spec,
    )


def word_level_tokenizer(vocab_size: int, pad_token_id: int = 0):
    """A real transformers tokenizer over ids 0..vocab_size-1 (no files needed)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token=f"t{pad_token_id}"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token=f"t{pad_token_id}", unk_token=f"t{pad_token_id}"
    )
