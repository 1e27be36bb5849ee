"""Hook mode's engine forward: what `get_mcore_forward_fused_model_engine_fn` returns for a hook-mode model.

Why our own: verl's engine forward hard-wires its processor, one float
temperature and every row, and exists for the packed layout only. Ours lays
the micro-batch out with verl's own helpers (packed or padded, `layouts.py`),
then calls the model with `fused_output_processor` and a context carrying
per-token temperatures, the rows to score, the configured backend and, when
the step asks for it, verl's loss to compute inside the op, or the outputs
beyond log-probs and entropy (the teacher top-k's distillation outputs, sum pi^2:
the op `token_log_probs`). What the step asks for arrives in one `HookStep`
(forward_step.py).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ..hook import FusedOutputProcessorContext, fused_output_processor
from ..log_once import log_once
from ..ops import backend_capabilities
from ..probe import unwrap_to_gpt
from ..switch import CONFIG_BACKEND_KEY, CONFIG_PREFIX
from .cp_loss import context_parallel_options
from .distillation import forward_kl_topk
from .forward_step import HookStep, current_step, sample_temperatures
from .layouts import BSHD, PackedLayout, PaddedLayout, refuse_packed_only_inputs
from .loss_support import FUSED_LOSS_OUTPUT_KEY, SEQUENCE
from .model_plan import counts_of, plan_of
from .ppo_loss import ppo_loss_of_rows, ppo_loss_on_host, ppo_row_gradients, row_groups
from .replay_carry import replayed_set_outputs

logger = logging.getLogger(__name__)

MULTI_MODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def check_backend_accepts(backend: str, temperature, score_rows) -> None:
    """Refuse per-step inputs the configured backend cannot take (verl's kernel: one float, every row)."""
    capabilities = backend_capabilities(backend)
    if isinstance(temperature, torch.Tensor) and not capabilities.per_row_temperature:
        raise ValueError(
            f"{CONFIG_PREFIX}.{CONFIG_BACKEND_KEY}={backend} cannot take per-sample temperatures (its kernel takes "
            "one float); choose another output_processor_backend, e.g. auto"
        )
    if score_rows is not None and not capabilities.row_selection:
        raise ValueError(
            f"score rows given with {CONFIG_PREFIX}.{CONFIG_BACKEND_KEY}={backend}, which scores every row"
        )


def _fused_loss_options(step: HookStep, layout: PackedLayout, labels: torch.Tensor) -> dict:
    """The context fields that compute the step's loss inside the op (the op sees [s, b] rows; verl's loss
    reads them unpacked like our result)."""
    request = step.fused_loss
    rows_shape, device = labels.t().shape, labels.device
    to_nested = lambda rows: layout.unpack(rows.t())  # noqa: E731
    options = dict(
        loss_fn=ppo_loss_of_rows(request.loss_function, request.data, to_nested, request.dp_group),
        loss_name=request.name,
        loss_chunk_bytes=request.chunk_bytes,
    )
    if request.cp_rank is not None:  # context parallelism: no collective per chunk (cp_loss.py)
        return {**options, **context_parallel_options(request, to_nested, rows_shape, device)}
    options["host_loss_fn"] = ppo_loss_on_host(
        request.loss_function, request.host_data, to_nested, rows_shape, device, request.dp_group
    )
    if request.config is not None:
        options["row_gradients"] = ppo_row_gradients(request.config, request.data, to_nested, rows_shape, device)
    if request.separability == SEQUENCE:
        options["loss_row_groups"] = row_groups(to_nested, rows_shape, device).t()
    return options


def _token_options(step: HookStep, layout, device, keep_logits_bytes: int) -> dict:
    """The context fields of a step that needs `token_log_probs`: the teacher's ids laid out like the labels
    (unrolled, as verl lays out the teacher for its logits processor), the student's top-k of the same k, sum pi^2."""
    options = {}
    if step.distillation is not None:
        distillation = step.distillation
        options.update(
            token_ids=layout.pack(distillation.teacher_ids.to(device)),
            top_k=distillation.top_k,
            calculate_log_probs=not distillation.distillation_only,
        )
    if step.sum_pi_squared:
        options["calculate_sum_pi_squared"] = True
    if options and keep_logits_bytes:
        log_once(
            logger,
            "verl_fused_hook: output_processor_keep_logits_gib is not used by steps with distillation_use_topk or "
            "calculate_sum_pi_squared (the op token_log_probs recomputes every row's logits)",
        )
    return options


def _replay_options(step: HookStep, layout, device, score_mask):
    """(the context's SamplingReplay with given kept ids in the model's layout, the score mask): rows without a given
    set (prompt, padding) are not scored, as verl reads none of them."""
    replay = step.replay
    if replay.kept_ids is None:
        return replay, score_mask
    ids = replay.kept_ids.to(device)
    # shifted by one so that the layout's zero padding reads as -1 (no set) after the shift back
    kept = layout.pack(torch.nested.nested_tensor_from_jagged(ids.values() + 1, offsets=ids.offsets())) - 1
    has_set = kept[..., 0] >= 0
    if score_mask is not None:  # packed from the batch as verl hands it: on the host (the hook moves it to the GPU)
        has_set = score_mask.to(device) & has_set
    return dataclasses.replace(replay, kept_ids=kept), has_set


def _one_width_across_context_parallel(kept: torch.Tensor, max_kept: int, local_cp_size) -> torch.Tensor:
    """verl's unpack all-gathers over context-parallel ranks, which needs one shape on every rank: there the sets
    are padded to the widest a set can be (a set, plus its label where added)."""
    from megatron.core import parallel_state

    if local_cp_size is None and parallel_state.get_context_parallel_world_size() == 1:
        return kept
    return torch.nn.functional.pad(kept, (0, max_kept + 1 - kept.shape[-1]), value=-1)


def make_engine_forward(vision_model: bool):
    """The engine forward for one architecture family (language model or VLM), like verl's factory."""

    def engine_forward(
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
        *,
        step: HookStep | None = None,
    ):
        """Fused log-probs (and entropy) of nested `labels` through the output_processor hook.

        The positional arguments are verl's engine-forward arguments. temperature: a float, or
        per-sample values [batch] (mixed temperatures), under verl's rule (`sample_temperatures`).
        step: what this step asks for (layout, scored rows, fused loss, MTP inputs); default the
        HookStep of the enclosing `forward_step`, or a plain packed step outside one.
        Returns {"log_probs": jagged, "entropy": jagged (when asked)} like verl's engine
        forward (plus the fused loss's result under FUSED_LOSS_OUTPUT_KEY, verl's top-k distillation
        outputs, "sum_pi_squared"; "log_probs" left out under distillation_only, as verl's unfused path
        does), or the hidden states on a non-last pipeline stage.
        """
        step = step or current_step() or HookStep()
        gpt = unwrap_to_gpt(model)
        plan = plan_of(model)
        backend = plan.backend
        temperature = sample_temperatures(temperature, input_ids.shape[0])
        check_backend_accepts(backend, temperature, step.score_rows)
        common = dict(vision_model=vision_model, pad_token_id=pad_token_id)
        if step.layout == BSHD:
            refuse_packed_only_inputs(local_cp_size, router_padding_mask, pad_to_length_bucket)
            layout = PaddedLayout(gpt, input_ids, labels, forced_max_seqlen=step.forced_max_seqlen, **common)
        else:
            layout = PackedLayout(
                gpt, input_ids, labels, cp_layout=cp_layout, local_cp_size=local_cp_size,
                pad_to_length_bucket=pad_to_length_bucket, mtp=step.mtp, **common,
            )  # fmt: skip
        model_inputs = layout.model_inputs()
        model_inputs.update(
            {key: multi_modal_inputs[key].to(input_ids.device) for key in MULTI_MODAL_KEYS if key in multi_modal_inputs}
        )
        if router_padding_mask is not None:
            model_inputs["padding_mask"] = router_padding_mask

        fused_loss = step.fused_loss if gpt.post_process else None
        tokens = _token_options(step, layout, input_ids.device, plan.keep_logits_bytes) if gpt.post_process else {}
        if backend_capabilities(backend).row_selection:
            score_mask = layout.score_mask(step.score_rows)
        else:
            if step.layout == BSHD:
                log_once(
                    logger,
                    f"verl_fused_hook: BSHD with output_processor_backend={backend} scores every row, padding included",
                )
            score_mask = None
        replay = None
        if step.replay is not None and gpt.post_process:
            replay, score_mask = _replay_options(step, layout, input_ids.device, score_mask)
        context = FusedOutputProcessorContext(
            temperature=layout.token_temperature(temperature),
            calculate_entropy=bool(calculate_entropy),
            score_mask=score_mask,
            backend=backend,
            batch_invariant=plan.batch_invariant,
            replay=replay,
            **(
                _fused_loss_options(step, layout, model_inputs["labels"])
                if fused_loss is not None
                else tokens or {"keep_logits_bytes": 0 if replay is not None else plan.keep_logits_bytes}
            ),
        )
        output = model(**model_inputs, output_processor=fused_output_processor, output_processor_context=context)
        if not gpt.post_process:
            return output
        counts = counts_of(gpt)
        counts.forwards += 1
        counts.fused_loss_forwards += fused_loss is not None
        result = {}
        if output.log_probs is not None:  # None: distillation_only, as verl's path leaves them out
            result["log_probs"] = layout.unpack(output.log_probs)
        if calculate_entropy:
            result["entropy"] = layout.unpack(output.entropy)
        if fused_loss is not None:
            result[FUSED_LOSS_OUTPUT_KEY] = (output.loss, output.loss_metrics)
        if step.distillation is not None:
            teacher_log_probs = layout.pack(step.distillation.teacher_log_probs.to(input_ids.device))
            outputs = forward_kl_topk(
                output.token_log_probs, output.top_ids, tokens["token_ids"], teacher_log_probs,
                step.distillation.log_prob_min_clamp, score_mask,
            )  # fmt: skip
            result.update({key: layout.unpack(value) for key, value in outputs.items()})
        if step.sum_pi_squared:
            result["sum_pi_squared"] = layout.unpack(output.sum_pi_squared)
        if replay is not None:
            kept = _one_width_across_context_parallel(output.kept_ids, replay.max_kept, local_cp_size)
            result.update(replayed_set_outputs(layout.unpack(kept)))
        return result

    return engine_forward
