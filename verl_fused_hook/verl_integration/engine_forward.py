"""Hook mode's engine forward: what `get_mcore_forward_fused_model_engine_fn` returns for a hook-mode model.

Why our own: verl's engine forward hard-wires its processor, one float
temperature and every row. Ours packs the same THD layout with verl's own
`preprocess_thd_engine` / `postprocess_thd_engine` (CP layouts, fp8 padding,
length buckets, VLM masks and router padding masks included), then calls the
model with `fused_output_processor` and a context carrying per-token
temperatures, the rows to score and the configured backend.
"""

from __future__ import annotations

import math

import torch

from ..hook import FusedOutputProcessorContext, fused_output_processor
from ..probe import unwrap_to_gpt
from ..switch import CONFIG_BACKEND_KEY, CONFIG_PREFIX, VERL_BACKEND
from .ppo_loss import FUSED_LOSS_OUTPUT_KEY, ppo_loss_of_rows, ppo_loss_on_host, ppo_row_gradients
from .model_plan import counts_of, plan_of
from .forward_step import current_step

MULTI_MODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def _per_token_nested(per_sample: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A jagged tensor shaped like `like` holding per_sample[i] on every position of sequence i."""
    offsets = like.offsets()
    values = per_sample.to(offsets.device).repeat_interleave(offsets.diff())
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


VERL_TEMPERATURE_FLOOR = 1e-8  # verl's floor for non-positive (padding) temperatures


def sample_temperatures(temperature, batch_size: int) -> float | torch.Tensor:
    """verl's rule for the engine forward's `temperature`, on real samples: a float, or an fp32 [batch] tensor.

    Non-finite values raise (verl's fused path refuses them, its unfused path
    asserts); values <= 0 are floored to 1e-8, as verl's unfused path does.
    """
    if isinstance(temperature, torch.Tensor):
        if not temperature.is_floating_point() or temperature.dim() != 1 or temperature.shape[0] != batch_size:
            raise ValueError(
                f"temperature: a tensor must be floating point and [batch] = [{batch_size}], "
                f"got {temperature.dtype} {tuple(temperature.shape)}"
            )
        if temperature.device.type == "meta":
            raise ValueError("temperature: a tensor on the meta device holds no values")
        if not bool(torch.isfinite(temperature).all()):
            raise ValueError(f"temperature: every per-sample value must be finite, got {temperature.tolist()}")
        return temperature.detach().float().clamp_min(VERL_TEMPERATURE_FLOOR)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature: expected a float or a tensor [batch], got {type(temperature).__name__}")
    if not math.isfinite(temperature):
        raise ValueError(f"temperature: must be finite, got {temperature}")
    return max(float(temperature), VERL_TEMPERATURE_FLOOR)


def check_backend_accepts(backend: str, temperature, score_rows) -> None:
    """Refuse per-step inputs verl's own kernel cannot take (shared by the THD and BSHD forwards)."""
    if backend != VERL_BACKEND:
        return
    if isinstance(temperature, torch.Tensor):
        raise ValueError(
            f"{CONFIG_PREFIX}.{CONFIG_BACKEND_KEY}=verl cannot take per-sample temperatures (verl's kernel takes "
            "one float); choose another output_processor_backend, e.g. auto"
        )
    if score_rows is not None:
        raise ValueError(f"score rows given with {CONFIG_PREFIX}.{CONFIG_BACKEND_KEY}=verl, which scores every row")


def make_hook_engine_forward(vision_model: bool):
    """The engine forward for one architecture family (language model or VLM), like verl's factory."""
    from verl.models.mcore.util import build_vlm_attn_mask_thd, postprocess_thd_engine, preprocess_thd_engine

    def hook_engine_forward(
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
        mtp=None,
    ):
        """Fused log-probs (and entropy) of nested `labels` through the output_processor hook.

        temperature: a float, or per-sample values [batch] (mixed temperatures); verl's rule
            applies (`sample_temperatures`: non-finite raises, <= 0 floored to 1e-8).
        score_rows: optional jagged bool shaped like input_ids; False positions are
            never computed and come back as 0 (only for callers that never read them).
        mtp: MtpStepInputs when the model trains its MTP layers: the loss mask,
            position ids and loss normalization reach the MTP loss as in verl's path.
        Returns {"log_probs": jagged, "entropy": jagged (when asked)} like verl's
        engine forward, or the hidden states on a non-last pipeline stage.
        """
        gpt = unwrap_to_gpt(model)
        backend = plan_of(model).backend
        temperature = sample_temperatures(temperature, input_ids.shape[0])
        check_backend_accepts(backend, temperature, score_rows)
        config = gpt.config
        layout = dict(
            use_fp8_padding=config.fp8 in ("e4m3", "hybrid"),
            min_local_rows=(
                config.csa_window_size if getattr(config, "experimental_attention_variant", None) == "dsv4_hybrid" else None
            ),
            pad_to_length_bucket=pad_to_length_bucket,
            cp_layout=cp_layout,
            local_cp_size=local_cp_size,
        )

        def pack(nested: torch.Tensor, **extra) -> torch.Tensor:
            return preprocess_thd_engine(nested, pre_process=True, **extra, **layout)[0].contiguous()

        # MTP layers on the last stage embed the input ids, so verl packs them there too
        pre_process = gpt.pre_process or (gpt.post_process and mtp is not None)
        packed_ids, packed_seq_params, position_ids = preprocess_thd_engine(input_ids, pre_process=pre_process, **layout)
        packed_ids = packed_ids.contiguous()
        packed_labels = pack(labels, need_roll=True)

        model_kwargs = {
            key: multi_modal_inputs[key].to(input_ids.device) for key in MULTI_MODAL_KEYS if key in multi_modal_inputs
        }
        if mtp is not None and gpt.post_process:
            model_kwargs["loss_mask"] = pack(mtp.loss_mask, need_roll=True)
            if mtp.normalization_factor is not None:
                packed_seq_params._verl_mtp_loss_normalization_factor = mtp.normalization_factor
        if router_padding_mask is not None:
            model_kwargs["padding_mask"] = router_padding_mask
        attention_mask = None
        if vision_model:
            packed_ids, attention_mask = build_vlm_attn_mask_thd(input_ids, pad_token_id)

        def unpack(values: torch.Tensor) -> torch.Tensor:
            return postprocess_thd_engine(
                values,
                packed_seq_params,
                input_ids,
                input_ids.shape[0],
                post_process=True,
                cp_layout=cp_layout,
                local_cp_size=local_cp_size,
            )

        step = current_step()
        fused_loss = step.fused_loss if step is not None and gpt.post_process else None
        loss_options = {}
        if fused_loss is not None:  # the op sees [s, b] rows; verl's loss reads them unpacked like our result
            rows_shape, device = packed_labels.t().shape, packed_labels.device
            to_nested = lambda rows: unpack(rows.t())  # noqa: E731
            loss_options = dict(
                loss_fn=ppo_loss_of_rows(fused_loss.loss_function, fused_loss.data, to_nested, fused_loss.dp_group),
                loss_name=fused_loss.name,
                row_gradients=ppo_row_gradients(fused_loss.config, fused_loss.data, to_nested, rows_shape, device),
                host_loss_fn=ppo_loss_on_host(
                    fused_loss.loss_function, fused_loss.host_data, to_nested, rows_shape, device, fused_loss.dp_group
                ),
                loss_chunk_bytes=fused_loss.chunk_bytes,
            )
        if isinstance(temperature, torch.Tensor):
            # Real positions hold their sample's temperature (>= 1e-8 after verl's floor); padding
            # positions pack as 0: give them 1.0 so every row holds a valid temperature.
            token_temperature = pack(_per_token_nested(temperature, input_ids))
            token_temperature = torch.where(token_temperature > 0, token_temperature, torch.ones_like(token_temperature))
        else:
            token_temperature = float(temperature)
        context = FusedOutputProcessorContext(
            temperature=token_temperature,
            # verl's kernel always computes both; asking it for less is refused by the context.
            calculate_entropy=bool(calculate_entropy) or backend == VERL_BACKEND,
            score_mask=None if score_rows is None else pack(score_rows),
            backend=backend,
            **loss_options,
        )
        output = model(
            input_ids=packed_ids,
            attention_mask=attention_mask,
            position_ids=position_ids if mtp is not None else None,  # only MTP reads them, as in verl's path
            packed_seq_params=packed_seq_params,
            labels=packed_labels,
            output_processor=fused_output_processor,
            output_processor_context=context,
            **model_kwargs,
        )
        if not gpt.post_process:
            return output
        counts = counts_of(gpt)
        counts.forwards += 1
        counts.fused_loss_forwards += fused_loss is not None
        result = {"log_probs": unpack(output.log_probs)}
        if calculate_entropy:
            result["entropy"] = unpack(output.entropy)
        if fused_loss is not None:
            result[FUSED_LOSS_OUTPUT_KEY] = (output.loss, output.loss_metrics)
        return result

    return hook_engine_forward
