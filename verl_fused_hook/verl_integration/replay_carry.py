"""pi_old's kept sets carried to the update and reference passes (sampling replay without the rollout's sets).

Why: when the rollout returns no kept sets, each pass would compute its own from its own logits, and pi_theta's sets
drift from pi_old's as soon as an optimizer step changes the weights: the PPO ratio would compare two supports. The
old-log-prob pass computes the sets once; every later pass of the step replays exactly those (DeepSeek-V3.2's "Keep
Sampling Mask").

How, through verl 0.9.1's own data flow (`RayPPOTrainer.fit`: old-log-prob pass, then reference, then update):
- worker side, every replay pass returns the sets it replayed as two extra outputs, CSR per sequence
  (`REPLAYED_COUNTS_KEY`: ids per position, jagged like log_probs; `REPLAYED_IDS_KEY`: the ids, one jagged row per
  sequence). Ragged rows survive verl's micro-batch concatenation (which unbinds sequences and needs equal trailing
  dims) and its DP gather, at the sets' own size rather than a fixed max_kept width;
- driver side, `_compute_old_log_prob` (which keeps only named outputs) is wrapped: it runs verl's own function with
  its worker group seen through `_RecordingWorkerGroup`, and when the pass computed the sets (the batch had no
  `rollout_kept_ids`) adds them to its result as `rollout_kept_ids`, which `fit` unions into the batch; the update
  (and reference) passes then replay them through the given-sets path;
- `_compute_ref_log_prob` is wrapped for `output_processor_sampling_replay_reference=false`: the reference pass gets
  the batch without kept sets and marked `FULL_VOCABULARY_KEY`, so its log-probs are over the whole vocabulary.

The driver side needs the plugin loaded in the driver process: the `verl.plugins` entry point (`import verl` loads
it), not `actor_rollout_ref.model.external_lib` alone. Without it the update pass finds no sets and says so.
"""

from __future__ import annotations

import functools

import torch

from ..switch import parse_config_replay_reference
from .sampling_replay import KEPT_IDS_KEY

REPLAYED_COUNTS_KEY = "replayed_kept_counts"  # int32 jagged like log_probs: ids in each position's kept set
REPLAYED_IDS_KEY = "replayed_kept_ids"  # int32 jagged, one row per sequence: its positions' ids, in order
FULL_VOCABULARY_KEY = "verl_fused_hook_full_vocabulary"  # non-tensor: this pass is not replayed


def replayed_set_outputs(kept: torch.Tensor) -> dict[str, torch.Tensor]:
    """The engine outputs of a replay pass from its kept sets, jagged [batch, positions, k] (-1 padding)."""
    values, offsets = kept.values(), kept.offsets()
    valid = values >= 0
    counts = valid.sum(dim=-1).to(torch.int32)
    ends = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int64)
    return {
        REPLAYED_COUNTS_KEY: torch.nested.nested_tensor_from_jagged(counts, offsets=offsets),
        REPLAYED_IDS_KEY: torch.nested.nested_tensor_from_jagged(values[valid].to(torch.int32), offsets=ends[offsets]),
    }


def kept_ids_of_outputs(output, batch_td) -> torch.Tensor:
    """`rollout_kept_ids` [batch, response_len, k] int32 (-1 padding; k the widest set) from a pass's replayed-set
    outputs, row-aligned with `responses` as verl's `no_padding_2_padding` aligns log_probs."""
    from verl.workers.utils.padding import no_padding_2_padding

    counts, ids = output[REPLAYED_COUNTS_KEY], output[REPLAYED_IDS_KEY]
    sequence_offsets = counts.offsets()
    flat_counts = counts.values().to(torch.int64)
    ends = flat_counts.cumsum(0)
    first_id = torch.nested.nested_tensor_from_jagged(ends - flat_counts, sequence_offsets)  # of each position's set
    starts = no_padding_2_padding(first_id, batch_td)
    response_counts = no_padding_2_padding(counts, batch_td).to(torch.int64)
    width = int(response_counts.max()) if response_counts.numel() else 0
    slot = torch.arange(width, device=response_counts.device)
    inside = slot < response_counts.unsqueeze(-1)
    flat_ids = ids.values()
    at = (starts.unsqueeze(-1) + slot).clamp(max=max(flat_ids.numel() - 1, 0))
    picked = flat_ids[at] if flat_ids.numel() else torch.zeros_like(at, dtype=torch.int32)
    return torch.where(inside, picked, torch.full_like(picked, -1)).to(torch.int32)


class _RecordingWorkerGroup:
    """A worker group seen through: each `compute_log_prob` call's (data, output) is kept in `calls`; the rest is
    the group's."""

    def __init__(self, worker_group):
        self._worker_group = worker_group
        self.calls = []

    def compute_log_prob(self, data):
        output = self._worker_group.compute_log_prob(data)
        self.calls.append((data, output))
        return output

    def __getattr__(self, name):
        return getattr(self._worker_group, name)


class _TrainerView:
    """The trainer with some attributes seen differently, for one call of one of its functions (nothing of the
    trainer changes)."""

    def __init__(self, trainer, **seen):
        self.__dict__.update(seen)
        self._trainer = trainer

    def __getattr__(self, name):
        return getattr(self._trainer, name)


def make_compute_old_log_prob(original):
    """Wrap `RayPPOTrainer._compute_old_log_prob`: sets the pass computed come back as `rollout_kept_ids`."""

    @functools.wraps(original)
    def compute_old_log_prob(self, batch):
        if KEPT_IDS_KEY in batch.batch.keys():  # the rollout's sets: the later passes replay them already
            return original(self, batch)
        recording = _RecordingWorkerGroup(self.actor_rollout_wg)
        old_log_prob, mfu = original(_TrainerView(self, actor_rollout_wg=recording), batch)
        ((data, output),) = recording.calls
        if REPLAYED_COUNTS_KEY not in output.keys():  # replay is off
            return old_log_prob, mfu
        old_log_prob.batch[KEPT_IDS_KEY] = kept_ids_of_outputs(output, data)
        return old_log_prob, mfu

    return compute_old_log_prob


def make_compute_ref_log_prob(original):
    """Wrap `RayPPOTrainer._compute_ref_log_prob`: with output_processor_sampling_replay_reference=false the
    reference pass runs over the whole vocabulary."""

    @functools.wraps(original)
    def compute_ref_log_prob(self, batch):
        options = self.config.actor_rollout_ref.model.get("fused_kernel_options") or {}
        if parse_config_replay_reference(options) is not False:
            return original(self, batch)
        from verl import DataProto

        full = DataProto(
            batch=batch.batch.exclude(KEPT_IDS_KEY),
            non_tensor_batch=batch.non_tensor_batch,
            meta_info={**batch.meta_info, FULL_VOCABULARY_KEY: True},
        )
        return original(self, full)

    return compute_ref_log_prob


def install_trainer_wrappers(trainer_module) -> None:
    """Wrap the driver's old-log-prob and reference passes (idempotent; `replacements.restore` puts verl's back)."""
    from .replacements import replace

    replace(trainer_module.RayPPOTrainer, "_compute_old_log_prob", make_compute_old_log_prob)
    replace(trainer_module.RayPPOTrainer, "_compute_ref_log_prob", make_compute_ref_log_prob)
