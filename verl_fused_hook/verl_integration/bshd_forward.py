"""Hook mode's engine forward for verl's padded (BSHD) layout: engines built with `use_remove_padding=False`.

Why: verl 0.9.1's only fused engine forward packs THD, so verl turns fused
kernels off for padded engines (models or attention backends that cannot take
packed sequences) and materializes full logits. This forward pads the batch
exactly as verl's unfused BSHD path does (`preprocess_bshd_engine`: rows
right-padded to the longest sequence, TP/CP/fp8 aligned, zigzag halves under
context parallelism; `build_vlm_attn_mask_bshd` for VLMs), calls the model with
`fused_output_processor`, and unpads with `postprocess_bshd_engine`. Padding
rows, and the rows a step never reads, are left out of the output-weight GEMM
by the context's score mask.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..hook import FusedOutputProcessorContext, fused_output_processor
from ..probe import unwrap_to_gpt
from ..switch import VERL_BACKEND
from .engine_forward import MULTI_MODAL_KEYS, check_backend_accepts, sample_temperatures
from .model_plan import counts_of, plan_of

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logger.info(message)


def _check_bshd_inputs(local_cp_size, router_padding_mask, pad_to_length_bucket) -> None:
    """verl's BSHD path has none of these (its engine allows them only with use_remove_padding=True)."""
    given = [
        name
        for name, value in (
            ("local_cp_size", local_cp_size),
            ("router_padding_mask", router_padding_mask),
            ("pad_to_length_bucket", pad_to_length_bucket),
        )
        if value is not None
    ]
    if given:
        raise ValueError(
            f"{given[0]}: dynamic context parallelism and length buckets need the packed (THD) layout "
            "(actor_rollout_ref.actor.megatron.use_remove_padding=True); the padded (BSHD) layout takes neither"
        )


def make_bshd_engine_forward(vision_model: bool):
    """The BSHD engine forward for one architecture family (language model or VLM), like verl's factory."""
    from verl.models.mcore.util import build_vlm_attn_mask_bshd, postprocess_bshd_engine, preprocess_bshd_engine

    def bshd_engine_forward(
        model,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        multi_modal_inputs: dict,
        temperature: float | torch.Tensor,
        calculate_entropy: bool,
        pad_token_id: int,
        cp_layout: str = "zigzag",
        local_cp_size: int | None = None,
        router_padding_mask: torch.Tensor | None = None,
        pad_to_length_bucket: int | None = None,
        score_rows: torch.Tensor | None = None,
        forced_max_seqlen: int | None = None,
    ):
        """Fused log-probs (and entropy) of nested `labels`, run on verl's padded [batch, seq] layout.

        temperature: a float, or per-sample values [batch] (broadcast over each sample's tokens), under
            verl's rule (`sample_temperatures`: non-finite raises, <= 0 floored to 1e-8).
        score_rows: optional jagged bool shaped like input_ids; False rows are never computed
            and come back as 0. Padding rows are never computed either (except by backend
            verl, whose kernel scores every row; logged once).
        forced_max_seqlen: verl's `pad_bshd_to_minibatch_max` length (raw, before alignment).
        cp_layout: accepted for the call signature; verl's BSHD helpers always split zigzag.
        Returns {"log_probs": jagged, "entropy": jagged (when asked)} like verl's engine
        forward, or the hidden states on a non-last pipeline stage.
        """
        _check_bshd_inputs(local_cp_size, router_padding_mask, pad_to_length_bucket)
        gpt = unwrap_to_gpt(model)
        backend = plan_of(model).backend
        temperature = sample_temperatures(temperature, input_ids.shape[0])  # verl's rule: NaN raises, <= 0 -> 1e-8
        check_backend_accepts(backend, temperature, score_rows)
        layout = dict(use_fp8_padding=gpt.config.fp8 in ("e4m3", "hybrid"), forced_max_seqlen=forced_max_seqlen)

        input_bshd, real_rows, position_ids = preprocess_bshd_engine(input_ids, pre_process=gpt.pre_process, **layout)
        labels_bshd = preprocess_bshd_engine(labels, pre_process=True, need_roll=True, **layout)[0].contiguous()
        attention_mask = real_rows
        if vision_model:
            input_bshd, attention_mask = build_vlm_attn_mask_bshd(
                input_ids, input_ids.shape[0], pad_token_id, forced_max_seqlen=forced_max_seqlen
            )
            position_ids = None

        if backend == VERL_BACKEND:
            _log_once("verl_fused_hook: BSHD with output_processor_backend=verl scores every row, padding included")
            score_mask = None
        elif score_rows is None:
            score_mask = real_rows
        else:
            score_mask = preprocess_bshd_engine(score_rows, pre_process=True, **layout)[0] & real_rows
        context = FusedOutputProcessorContext(
            temperature=temperature,
            # verl's kernel always computes both; asking it for less is refused by the context.
            calculate_entropy=bool(calculate_entropy) or backend == VERL_BACKEND,
            score_mask=score_mask,
            backend=backend,
        )
        model_kwargs = {
            key: multi_modal_inputs[key].to(input_ids.device) for key in MULTI_MODAL_KEYS if key in multi_modal_inputs
        }
        output = model(
            input_ids=input_bshd,
            attention_mask=attention_mask,
            position_ids=position_ids,
            labels=labels_bshd,
            output_processor=fused_output_processor,
            output_processor_context=context,
            **model_kwargs,
        )
        if not gpt.post_process:
            return output
        counts_of(gpt).forwards += 1
        result = {"log_probs": postprocess_bshd_engine(output.log_probs, real_rows)}
        if calculate_entropy:
            result["entropy"] = postprocess_bshd_engine(output.entropy, real_rows)
        return result

    return bshd_engine_forward
