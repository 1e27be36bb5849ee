"""How hook mode lays a verl micro-batch out for the model: packed (THD) or padded (BSHD), with verl's own helpers.

Why two strategies behind one interface: verl's engine runs packed sequences
(`use_remove_padding=True`, `preprocess_thd_engine`) or padded rows
(`use_remove_padding=False`, `preprocess_bshd_engine`, for models or attention
backends that cannot take packed batches). verl 0.9.1 has a fused forward for
the packed layout only; everything else hook mode does (temperatures, scored
rows, the processor context, the output) is the same on both, so the engine
forward (`engine_forward.py`) is written once against this interface:

- `model_inputs()`: what `GPTModel.forward` takes besides the processor;
- `pack(nested)`: a jagged per-token tensor in the model's `[b, s]` label layout;
- `unpack(values)`: the processor's `[b, s]` output back to verl's jagged layout;
- `token_temperature(t)`: a float, or per-sample values spread over the layout;
- `score_mask(rows)`: the rows the output layer multiplies (None: every row).
"""

from __future__ import annotations

import torch

THD, BSHD = "thd", "bshd"


def _per_token_nested(per_sample: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A jagged tensor shaped like `like` holding per_sample[i] on every position of sequence i."""
    offsets = like.offsets()
    values = per_sample.to(offsets.device).repeat_interleave(offsets.diff())
    return torch.nested.nested_tensor_from_jagged(values, offsets=offsets)


class PackedLayout:
    """THD: sequences packed end to end (CP layouts, fp8 padding, length buckets and VLM masks by verl's helpers).

    mtp: the step's MtpStepInputs when the model trains its MTP layers (they embed the input ids on the last
    stage and read the loss mask and position ids there)."""

    def __init__(
        self,
        gpt,
        input_ids,
        labels,
        *,
        vision_model: bool,
        pad_token_id: int,
        cp_layout: str,
        local_cp_size,
        pad_to_length_bucket,
        mtp,
    ):
        from verl.models.mcore.util import build_vlm_attn_mask_thd, postprocess_thd_engine, preprocess_thd_engine

        config = gpt.config
        self._preprocess, self._postprocess = preprocess_thd_engine, postprocess_thd_engine
        self._input_ids, self._cp_layout, self._local_cp_size = input_ids, cp_layout, local_cp_size
        self._options = dict(
            use_fp8_padding=config.fp8 in ("e4m3", "hybrid"),
            min_local_rows=(
                config.csa_window_size
                if getattr(config, "experimental_attention_variant", None) == "dsv4_hybrid"
                else None
            ),
            pad_to_length_bucket=pad_to_length_bucket,
            cp_layout=cp_layout,
            local_cp_size=local_cp_size,
        )
        pre_process = gpt.pre_process or (gpt.post_process and mtp is not None)
        packed_ids, self._packed_seq_params, position_ids = preprocess_thd_engine(
            input_ids, pre_process=pre_process, **self._options
        )
        attention_mask = None
        if vision_model:
            packed_ids, attention_mask = build_vlm_attn_mask_thd(input_ids, pad_token_id)
        self._inputs = dict(
            input_ids=packed_ids.contiguous(),
            attention_mask=attention_mask,
            position_ids=position_ids if mtp is not None else None,  # only MTP reads them, as in verl's path
            packed_seq_params=self._packed_seq_params,
            labels=self.pack(labels, need_roll=True),
        )
        if mtp is not None and gpt.post_process:
            self._inputs["loss_mask"] = self.pack(mtp.loss_mask, need_roll=True)
            if mtp.normalization_factor is not None:
                self._packed_seq_params._verl_mtp_loss_normalization_factor = mtp.normalization_factor

    def model_inputs(self) -> dict:
        return dict(self._inputs)

    def pack(self, nested: torch.Tensor, need_roll: bool = False) -> torch.Tensor:
        return self._preprocess(nested, pre_process=True, need_roll=need_roll, **self._options)[0].contiguous()

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        return self._postprocess(
            values, self._packed_seq_params, self._input_ids, self._input_ids.shape[0], post_process=True,
            cp_layout=self._cp_layout, local_cp_size=self._local_cp_size,
        )  # fmt: skip

    def token_temperature(self, temperature: float | torch.Tensor) -> float | torch.Tensor:
        if not isinstance(temperature, torch.Tensor):
            return temperature
        # Real positions hold their sample's temperature (>= 1e-8 after verl's floor); padding
        # positions pack as 0: give them 1.0 so every row holds a valid temperature.
        per_token = self.pack(_per_token_nested(temperature, self._input_ids))
        return torch.where(per_token > 0, per_token, torch.ones_like(per_token))

    def score_mask(self, score_rows: torch.Tensor | None) -> torch.Tensor | None:
        return None if score_rows is None else self.pack(score_rows)


class PaddedLayout:
    """BSHD: rows right-padded to the longest sequence (TP/CP/fp8 aligned, zigzag halves under CP) exactly as
    verl's unfused BSHD path pads them; padding rows never reach the output layer.

    forced_max_seqlen: verl's `pad_bshd_to_minibatch_max` length (raw, before alignment)."""

    def __init__(self, gpt, input_ids, labels, *, vision_model: bool, pad_token_id: int, forced_max_seqlen):
        from verl.models.mcore.util import build_vlm_attn_mask_bshd, postprocess_bshd_engine, preprocess_bshd_engine

        self._preprocess, self._postprocess = preprocess_bshd_engine, postprocess_bshd_engine
        self._options = dict(use_fp8_padding=gpt.config.fp8 in ("e4m3", "hybrid"), forced_max_seqlen=forced_max_seqlen)
        input_bshd, self._real_rows, position_ids = preprocess_bshd_engine(
            input_ids, pre_process=gpt.pre_process, **self._options
        )
        attention_mask = self._real_rows
        if vision_model:
            input_bshd, attention_mask = build_vlm_attn_mask_bshd(
                input_ids, input_ids.shape[0], pad_token_id, forced_max_seqlen=forced_max_seqlen
            )
            position_ids = None
        self._inputs = dict(
            input_ids=input_bshd,
            attention_mask=attention_mask,
            position_ids=position_ids,
            labels=self.pack(labels, need_roll=True),
        )

    def model_inputs(self) -> dict:
        return dict(self._inputs)

    def pack(self, nested: torch.Tensor, need_roll: bool = False) -> torch.Tensor:
        return self._preprocess(nested, pre_process=True, need_roll=need_roll, **self._options)[0].contiguous()

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        return self._postprocess(values, self._real_rows)

    def token_temperature(self, temperature: float | torch.Tensor) -> float | torch.Tensor:
        return temperature  # per-sample [b]: the processor spreads it over each row's tokens

    def score_mask(self, score_rows: torch.Tensor | None) -> torch.Tensor:
        if score_rows is None:
            return self._real_rows
        return self.pack(score_rows) & self._real_rows


def refuse_packed_only_inputs(local_cp_size, router_padding_mask, pad_to_length_bucket) -> None:
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
