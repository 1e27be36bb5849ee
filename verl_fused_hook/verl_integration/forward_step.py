"""Per-step inputs verl's `forward_step` does not pass to the fused forward: mixed temperatures and scored rows.

Why: `MegatronEngineWithLMHead.forward_step` reduces the batch's temperatures
to one float (raising NotImplementedError when they differ) and calls the
fused forward without the batch, so the forward cannot know which rows its
caller reads. In hook mode we wrap `forward_step` to note, for the duration of
that one call, that per-sample temperatures may pass and which rows verl will
read, and which layout (packed THD or padded BSHD) the engine runs;
`_resolve_fused_temperature` and the engine forward consult that note.
Outside a hook-mode step both behave exactly as verl's originals. verl's rule for
the temperatures both take (finite; values <= 0 floored to VERL_TEMPERATURE_FLOOR)
is written here once (`sample_temperatures` for the engine forward's argument).

Rows verl reads: `no_padding_2_padding` (used by `ppo_loss` and by the trainer
for old/ref log-probs and entropy) reads, per sequence of prompt length P and
response length R, positions P-1 ... P+R-2: the predictions of response
tokens. Steps whose loss is `ppo_loss` or None (forward only) and whose batch
carries `prompts` and `responses` therefore score only those rows. Any other
loss (SFT, distillation) may read every row, so every row is computed, and a
line is logged once per reason.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
from dataclasses import dataclass

import torch

from ..checks import is_number
from ..context import SamplingReplay
from ..log_once import log_once
from ..ops import backend_capabilities
from ..probe import unwrap_to_gpt
from ..switch import (
    CONFIG_BACKEND_KEY,
    CONFIG_PREFIX,
    CONFIG_REPLAY_KEY,
    CONFIG_REPLAY_REFERENCE_KEY,
    CONFIG_SCORE_MASK_KEY,
    HOOK,
)
from .distillation import TopKDistillation, check_teacher_fields, distillation_config_of, topk_distillation
from .layouts import BSHD, THD
from .loss_support import FusedLossRequest, fused_loss_request, fused_result_loss
from .model_plan import plan_of
from .mtp import MtpStepInputs, mtp_step_inputs, mtp_training_of
from .replay_carry import FULL_VOCABULARY_KEY
from .sampling_replay import KEPT_IDS_KEY, step_replay

logger = logging.getLogger(__name__)

VERL_TEMPERATURE_FLOOR = 1e-8  # verl's floor for non-positive (padding) temperatures


@dataclass(frozen=True)
class HookStep:
    score_rows: torch.Tensor | None = None  # jagged bool shaped like input_ids, or None: every row
    layout: str = THD  # verl's data_format for this engine: packed (thd) or padded (bshd)
    forced_max_seqlen: int | None = None  # BSHD: verl's pad_bshd_to_minibatch_max length
    fused_loss: FusedLossRequest | None = None  # output_processor_fused_loss: the loss the op computes
    mtp: MtpStepInputs | None = None  # when the model trains its MTP layers
    distillation: TopKDistillation | None = None  # distillation_use_topk: verl's top-k distillation outputs
    sum_pi_squared: bool = False  # calculate_sum_pi_squared: sum_j p_j^2 per row in the output
    replay: SamplingReplay | None = None  # output_processor_sampling_replay: kept sets by prediction row, or truncation


_current_step: contextvars.ContextVar[HookStep | None] = contextvars.ContextVar("verl_fused_hook_step", default=None)


def current_step() -> HookStep | None:
    return _current_step.get()


def _reads_response_rows_only(loss_function) -> bool:
    if loss_function is None:
        return True
    from verl.trainer.distillation.losses import distillation_ppo_loss
    from verl.workers.utils.losses import ppo_loss

    return getattr(loss_function, "func", loss_function) in (ppo_loss, distillation_ppo_loss)


def _prompt_and_response_lengths(batch) -> tuple[torch.Tensor, torch.Tensor]:
    prompts, responses = batch["prompts"], batch["responses"]
    if prompts.is_nested:
        return prompts.offsets().diff(), responses.offsets().diff()
    attention_mask = batch["attention_mask"]
    split = prompts.shape[1]
    return attention_mask[:, :split].sum(dim=1), attention_mask[:, split:].sum(dim=1)


def response_score_rows(batch, loss_function) -> torch.Tensor | None:
    """Jagged bool shaped like batch["input_ids"]: True on the rows verl reads, or None for every row."""
    name = getattr(getattr(loss_function, "func", loss_function), "__name__", repr(loss_function))
    if not _reads_response_rows_only(loss_function):
        log_once(logger, f"verl_fused_hook: score_mask off, loss {name} may read every row")
        return None
    if "prompts" not in batch.keys() or "responses" not in batch.keys():
        log_once(logger, f"verl_fused_hook: score_mask off, the batch has no prompts/responses (loss {name})")
        return None
    input_ids = batch["input_ids"]
    offsets = input_ids.offsets()
    prompt_lens, response_lens = (t.to(offsets.device) for t in _prompt_and_response_lengths(batch))
    if not torch.equal(prompt_lens + response_lens, offsets.diff()) or bool((prompt_lens < 1).any()):
        log_once(logger, "verl_fused_hook: score_mask off, prompt+response lengths do not match input_ids")
        return None
    position = torch.arange(int(offsets[-1]), device=offsets.device) - offsets[:-1].repeat_interleave(offsets.diff())
    start = (prompt_lens - 1).repeat_interleave(offsets.diff())
    stop = (prompt_lens + response_lens - 1).repeat_interleave(offsets.diff())
    rows = (position >= start) & (position < stop)
    return torch.nested.nested_tensor_from_jagged(rows, offsets=offsets)


def _layout_of(engine, batch) -> dict:
    """The layout verl's forward_step picks (`data_format = "thd" if use_remove_padding else "bshd"`)."""
    if engine.engine_config.use_remove_padding:
        return {"layout": THD}
    from verl.utils import tensordict_utils as tu

    return {"layout": BSHD, "forced_max_seqlen": tu.get_non_tensor_data(batch, key="forced_max_seqlen", default=None)}


def _uses_estimator(distillation_config) -> bool:
    return distillation_config is not None and distillation_config.distillation_loss.loss_settings.use_estimator


def token_step(batch, model, loss_function, backend: str) -> tuple[dict, object]:
    """(HookStep fields for the outputs beyond log-probs and entropy, the batch verl's forward_step is shown).

    Teacher fields are checked here, before the model runs, on every pipeline stage alike (ValueError naming the
    field); a backend without `token_log_probs` is refused for the steps that need it."""
    from verl.utils import tensordict_utils as tu

    fields = {}
    vocab_size = unwrap_to_gpt(model).vocab_size
    if tu.get_non_tensor_data(batch, key="distillation_use_topk", default=False):
        only = tu.get_non_tensor_data(batch, key="distillation_only", default=False)
        fields["distillation"] = topk_distillation(batch, loss_function, vocab_size, only)
        log_once(
            logger,
            "verl_fused_hook: distillation_use_topk: verl's forward_kl_topk outputs (per-token KL, masses, overlap) "
            "from the op token_log_probs in the hook: the teacher's ids' log-probs and the student's top-k from "
            "hidden states, no [tokens, vocab] logits (two passes, logits recomputed in backward)",
        )
    elif _uses_estimator(distillation_config_of(loss_function)):
        check_teacher_fields(batch, vocab_size, ids_read=False, entries=1)  # verl's estimators read one per token
    if tu.get_non_tensor_data(batch, key="calculate_sum_pi_squared", default=False):
        fields["sum_pi_squared"] = True
        log_once(logger, "verl_fused_hook: calculate_sum_pi_squared: sum_pi_squared from the op token_log_probs")
        batch = batch.copy()  # the caller's micro-batch keeps its flag
        tu.assign_non_tensor(batch, calculate_sum_pi_squared=False)
    if fields and not backend_capabilities(backend).selected_tokens:
        asked = "distillation_use_topk" if "distillation" in fields else "calculate_sum_pi_squared"
        raise ValueError(
            f"{CONFIG_PREFIX}.{CONFIG_BACKEND_KEY}={backend} cannot run a step with {asked}: it needs the op "
            "token_log_probs, and verl's kernel returns the label's log-prob and entropy only; use auto"
        )
    return fields, batch


def replay_of_step(batch, plan, tokens: dict, forward_only: bool) -> SamplingReplay | None:
    """The step's SamplingReplay when the plan turns replay on (ValueError for a step it cannot mean anything for).

    A training step replays given sets only (the rollout's, or pi_old's carried from the old-log-prob pass,
    replay_carry.py): sets computed from pi_theta's own logits would leave pi_old's support once the weights move."""
    from verl.utils import tensordict_utils as tu

    if not plan.sampling_replay:
        return None
    if tu.get_non_tensor_data(batch, key=FULL_VOCABULARY_KEY, default=False):
        log_once(
            logger,
            f"verl_fused_hook: {CONFIG_REPLAY_REFERENCE_KEY}=false: the reference pass runs over the whole vocabulary",
        )
        return None
    asked = next((name for name in ("distillation", "sum_pi_squared") if tokens.get(name)), None)
    if asked is not None:
        flag = "distillation_use_topk" if asked == "distillation" else "calculate_sum_pi_squared"
        raise ValueError(
            f"{CONFIG_PREFIX}.{CONFIG_REPLAY_KEY}=true cannot run a step with {flag}: it reads the full-vocabulary "
            f"distribution, not the kept set; set {CONFIG_REPLAY_KEY} to false for such a job"
        )
    if KEPT_IDS_KEY in batch.keys():
        if "prompts" not in batch.keys() or "responses" not in batch.keys():
            raise ValueError(f"{KEPT_IDS_KEY}: the batch needs prompts and responses to place the rollout's sets")
        return step_replay(batch, plan, *_prompt_and_response_lengths(batch))
    if not forward_only:
        raise ValueError(
            f"{KEPT_IDS_KEY}: {CONFIG_PREFIX}.{CONFIG_REPLAY_KEY}=true needs the kept sets in the update batch, the "
            "rollout's or pi_old's; verl_fused_hook carries pi_old's from the old-log-prob pass when it is loaded in "
            "the driver process (the verl.plugins entry point, which `import verl` loads; external_lib alone loads it "
            "in the workers only). With algorithm.rollout_correction.bypass_mode=true there is no old-log-prob pass: "
            f"the rollout must return {KEPT_IDS_KEY}"
        )
    log_once(
        logger,
        f"verl_fused_hook: {CONFIG_REPLAY_KEY}: the batch carries no {KEPT_IDS_KEY}; kept sets computed from the "
        "trainer's logits with vLLM's rule",
    )
    return step_replay(batch, plan, None, None)


def make_forward_step(original):
    """Wrap verl's forward_step: in hook mode, run it inside a HookStep; otherwise call it untouched."""

    @functools.wraps(original)
    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        plan = plan_of(model)
        if not (self.engine_config.use_fused_kernels and plan is not None and plan.mode == HOOK):
            return original(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func)
        batch = next(batch_iter)
        tokens, batch = token_step(batch, model, logits_processor_func, plan.backend)
        if not backend_capabilities(plan.backend).row_selection:
            log_once(
                logger, f"verl_fused_hook: score_mask off, output_processor_backend={plan.backend} scores every row"
            )
            rows = None
        elif not plan.score_mask:
            log_once(logger, f"verl_fused_hook: score_mask off, {CONFIG_SCORE_MASK_KEY}=false")
            rows = None
        else:
            rows = response_score_rows(batch, logits_processor_func)
        layout = _layout_of(self, batch)
        # only verl's own postprocess partial says whether this is a training step
        forward_only = getattr(postprocess_micro_batch_func, "keywords", {}).get("forward_only", True)
        fused = None
        if plan.fused_loss and layout["layout"] == BSHD:
            log_once(
                logger,
                "verl_fused_hook: output_processor_fused_loss: the padded (BSHD) layout is not fused; two-pass path",
            )
        elif plan.fused_loss and tokens.get("sum_pi_squared") and not forward_only:
            log_once(
                logger,
                "verl_fused_hook: output_processor_fused_loss: a training step with calculate_sum_pi_squared is not "
                "fused (sum_pi_squared comes from the op token_log_probs); two-pass path",
            )
        elif plan.fused_loss and plan.sampling_replay:
            log_once(
                logger,
                "verl_fused_hook: output_processor_fused_loss: a step with output_processor_sampling_replay is not "
                "fused (replayed_log_probs has no loss inside); two-pass path",
            )
        elif plan.fused_loss:
            fused = fused_loss_request(self, batch, logits_processor_func, forward_only, plan.fused_loss_chunk_bytes)
        if fused is not None:
            batch = fused.data
            postprocess_micro_batch_func = functools.partial(
                postprocess_micro_batch_func, loss_function=fused_result_loss
            )
        mtp = mtp_step_inputs(self, batch) if mtp_training_of(model) else None
        replay = replay_of_step(batch, plan, tokens, forward_only)
        token = _current_step.set(
            HookStep(score_rows=rows, fused_loss=fused, mtp=mtp, replay=replay, **layout, **tokens)
        )
        try:
            return original(self, iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)
        finally:
            _current_step.reset(token)

    return forward_step


def make_resolve_fused_temperature(original):
    """Wrap verl's `_resolve_fused_temperature`: inside a hook step mixed temperatures pass as a tensor [batch]."""

    @functools.wraps(original)
    def resolve_fused_temperature(temperature):
        if current_step() is None:
            return original(temperature)
        values = torch.as_tensor(temperature).detach().flatten()
        if values.numel() == 0 or not bool(torch.isfinite(values).all()) or bool((values == values[0]).all()):
            return original(temperature)  # verl's own checks and its float for uniform temperatures
        return values.float().clamp_min(VERL_TEMPERATURE_FLOOR)

    return resolve_fused_temperature


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
    if not is_number(temperature):
        raise ValueError(f"temperature: expected a float or a tensor [batch], got {type(temperature).__name__}")
    if not math.isfinite(temperature):
        raise ValueError(f"temperature: must be finite, got {temperature}")
    return max(float(temperature), VERL_TEMPERATURE_FLOOR)
