"""Which fused forward an engine uses: the environment switch, the trainer config entries, and their precedence.

Why one module: the environment variable, the two config entries and their
precedence must be read the same way by the engine integration, the A/B
script and the tests, and every bad value must fail at start-up with the same
message naming the field and the allowed values.

Precedence (documented in docs/usage.md):
1. `VERL_FUSED_USE_OP_HOOK` when set ("1" hook, "0" legacy) wins; a config entry
   that disagrees is overridden, and the log line says so.
2. Otherwise `actor_rollout_ref.model.fused_kernel_options.use_output_processor_hook`
   (true hook, false legacy).
3. Neither set: mode "unset", the plugin leaves verl's fused path as verl ships it.
The op backend comes only from `...fused_kernel_options.output_processor_backend`
(default "auto") and only matters in hook mode, as does `...output_processor_fused_loss`
(default false: the actor update's ppo_loss computed inside the op, see verl_integration/ppo_loss.py)
and its memory budget `...output_processor_fused_loss_chunk_gib` (default null: the op's),
`...output_processor_score_mask` (default true: only the rows verl reads are scored; false scores every row),
and `...output_processor_keep_logits_gib` (default null: none; the memory the op may hold from the output
layer's forward to its backward to keep logits instead of recomputing them, where the loss is not fused),
`...output_processor_batch_invariant` (default false: a sequence's log-probs and entropy still have the same bits
whatever micro-batch computes them on the Triton and verl backends; true also asks it of the top-k's ties and
refuses a backend that cannot give it, the portable one on CUDA; docs/op.md),
`...output_processor_sampling_replay` (default false: log-probs over the whole vocabulary; true: renormalized over the
rollout's top-k / top-p kept set, checked against the rollout config in verl_integration/sampling_replay.py) and its
bound `...output_processor_sampling_replay_max_kept` (default 512: the widest kept set), and
`...output_processor_sampling_replay_reference` (default true: the reference pass replays the same kept sets as
pi_old and pi_theta; false: reference log-probs over the whole vocabulary; applied by the driver, replay_carry.py).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from .checks import is_number
from .ops import BACKEND_CHOICES, backend_capabilities
from .ops.kept_sets import DEFAULT_MAX_KEPT

ENV_VAR = "VERL_FUSED_USE_OP_HOOK"
ENV_VALUES = {"1": "hook", "0": "legacy"}

CONFIG_PREFIX = "actor_rollout_ref.model.fused_kernel_options"
CONFIG_HOOK_KEY = "use_output_processor_hook"
CONFIG_BACKEND_KEY = "output_processor_backend"
CONFIG_FUSED_LOSS_KEY = "output_processor_fused_loss"
CONFIG_FUSED_LOSS_CHUNK_KEY = "output_processor_fused_loss_chunk_gib"
CONFIG_SCORE_MASK_KEY = "output_processor_score_mask"
CONFIG_KEEP_LOGITS_KEY = "output_processor_keep_logits_gib"
CONFIG_BATCH_INVARIANT_KEY = "output_processor_batch_invariant"
CONFIG_REPLAY_KEY = "output_processor_sampling_replay"
CONFIG_REPLAY_MAX_KEPT_KEY = "output_processor_sampling_replay_max_kept"
CONFIG_REPLAY_REFERENCE_KEY = "output_processor_sampling_replay_reference"
CONFIG_KEYS = (
    CONFIG_HOOK_KEY,
    CONFIG_BACKEND_KEY,
    CONFIG_FUSED_LOSS_KEY,
    CONFIG_FUSED_LOSS_CHUNK_KEY,
    CONFIG_SCORE_MASK_KEY,
    CONFIG_KEEP_LOGITS_KEY,
    CONFIG_BATCH_INVARIANT_KEY,
    CONFIG_REPLAY_KEY,
    CONFIG_REPLAY_MAX_KEPT_KEY,
    CONFIG_REPLAY_REFERENCE_KEY,
)
# Keys of ours start so; any other key of fused_kernel_options is verl's (e.g. impl_backend) unless it is a
# near miss of ours (at most this many single-letter edits away).
CONFIG_NAMESPACE = ("use_output_processor", "output_processor")
NEAR_MISS_EDITS = 2

DEFAULT_BACKEND = "auto"

HOOK = "hook"
LEGACY = "legacy"
UNSET = "unset"


@dataclass(frozen=True)
class FusedForwardPlan:
    """The resolved choice for one engine: mode, op backend, and where each came from."""

    mode: str  # HOOK, LEGACY or UNSET
    backend: str | None  # the op backend in hook mode, else None
    source: str  # human-readable origin of the mode
    note: str | None = None  # an override or ignored entry worth a log line
    fused_loss: bool = False  # hook mode computes the actor update's ppo_loss inside the op
    fused_loss_chunk_bytes: int | None = None  # the op's chunk of stored logits (None: its default)
    score_mask: bool = True  # hook mode scores only the rows the step's loss reads (where it can tell)
    keep_logits_bytes: int = 0  # hook mode's op keeps logits for its backward within this (0: recomputes them)
    batch_invariant: bool = False  # hook mode's op gives a row the same bits whatever batch computes it
    sampling_replay: bool = False  # hook mode renormalizes log-probs over the rollout's kept sets
    replay_max_kept: int = DEFAULT_MAX_KEPT  # the widest kept set replay accepts or computes
    # the rollout's truncation, filled in where the rollout config is read (verl_integration/sampling_replay.py)
    replay_top_k: int = -1
    replay_top_p: float = 1.0

    @property
    def is_set(self) -> bool:
        return self.mode != UNSET

    def log_line(self, engine_name: str) -> str:
        if self.mode == HOOK:
            text = (
                f"verl_fused_hook: {engine_name} uses the output_processor hook, backend={self.backend} ({self.source})"
            )
            if self.fused_loss:
                text += f", {CONFIG_FUSED_LOSS_KEY}=true"
            if self.fused_loss and self.fused_loss_chunk_bytes is not None:
                text += f" ({CONFIG_FUSED_LOSS_CHUNK_KEY}={self.fused_loss_chunk_bytes / 1024**3:g})"
            if not self.score_mask:
                text += f", {CONFIG_SCORE_MASK_KEY}=false"
            if self.keep_logits_bytes:
                text += f", {CONFIG_KEEP_LOGITS_KEY}={self.keep_logits_bytes / 1024**3:g}"
            if self.batch_invariant:
                text += f", {CONFIG_BATCH_INVARIANT_KEY}=true"
            if self.sampling_replay:
                text += (
                    f", {CONFIG_REPLAY_KEY}=true (rollout top_k={self.replay_top_k}, top_p={self.replay_top_p:g}, "
                    f"{CONFIG_REPLAY_MAX_KEPT_KEY}={self.replay_max_kept})"
                )
        elif self.mode == LEGACY:
            text = f"verl_fused_hook: {engine_name} uses verl's legacy fused forward ({self.source})"
        else:
            text = f"verl_fused_hook: {engine_name} left as verl ships it ({self.source})"
        return f"{text}; {self.note}" if self.note else text


def parse_env(environ: Mapping[str, str] | None = None) -> str | None:
    """The mode the environment asks for (HOOK/LEGACY) or None when the variable is unset."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV_VAR)
    if raw is None:
        return None
    value = raw.strip()
    if value not in ENV_VALUES:
        raise ValueError(
            f"{ENV_VAR}={raw!r} is not allowed; use 1 (output_processor hook), 0 (verl's legacy fused forward) "
            f"or leave it unset (plugin inactive)"
        )
    return ENV_VALUES[value]


def parse_config_mode(options: Mapping | None) -> str | None:
    """The mode `fused_kernel_options.use_output_processor_hook` asks for, or None when absent/null."""
    value = _parse_config_bool(options, CONFIG_HOOK_KEY, "unset")
    if value is None:
        return None
    return HOOK if value else LEGACY


def parse_config_backend(options: Mapping | None) -> str | None:
    """The op backend `fused_kernel_options.output_processor_backend` names, or None when absent/null."""
    value = None if options is None else options.get(CONFIG_BACKEND_KEY)
    if value is None:
        return None
    if value not in BACKEND_CHOICES:
        raise ValueError(
            f"{CONFIG_PREFIX}.{CONFIG_BACKEND_KEY}={value!r} is not allowed; use one of {', '.join(BACKEND_CHOICES)}"
        )
    return value


def _parse_config_bool(options: Mapping | None, key: str, null_means: str) -> bool | None:
    """`fused_kernel_options.<key>` as a bool, or None when absent/null."""
    value = None if options is None else options.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise ValueError(f"{CONFIG_PREFIX}.{key}={value!r} is not allowed; use true, false or null ({null_means})")
    return value


def parse_config_fused_loss(options: Mapping | None) -> bool | None:
    """`fused_kernel_options.output_processor_fused_loss` as a bool, or None when absent/null."""
    return _parse_config_bool(options, CONFIG_FUSED_LOSS_KEY, "off")


def parse_config_batch_invariant(options: Mapping | None) -> bool | None:
    """`fused_kernel_options.output_processor_batch_invariant` as a bool, or None when absent/null."""
    return _parse_config_bool(options, CONFIG_BATCH_INVARIANT_KEY, "off")


def parse_config_sampling_replay(options: Mapping | None) -> bool | None:
    """`fused_kernel_options.output_processor_sampling_replay` as a bool, or None when absent/null."""
    return _parse_config_bool(options, CONFIG_REPLAY_KEY, "off")


def parse_config_replay_reference(options: Mapping | None) -> bool | None:
    """`fused_kernel_options.output_processor_sampling_replay_reference` as a bool, or None when absent/null."""
    return _parse_config_bool(options, CONFIG_REPLAY_REFERENCE_KEY, "true: the reference replays the kept sets")


def parse_config_replay_max_kept(options: Mapping | None) -> int | None:
    """`fused_kernel_options.output_processor_sampling_replay_max_kept` (an int >= 1), or None when absent/null."""
    value = None if options is None else options.get(CONFIG_REPLAY_MAX_KEPT_KEY)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{CONFIG_PREFIX}.{CONFIG_REPLAY_MAX_KEPT_KEY}={value!r} is not allowed; use an integer >= 1 (the widest "
            f"kept set, at least rollout.top_k) or null ({DEFAULT_MAX_KEPT})"
        )
    return value


def parse_config_score_mask(options: Mapping | None) -> bool | None:
    """`fused_kernel_options.output_processor_score_mask` as a bool, or None when absent/null."""
    return _parse_config_bool(options, CONFIG_SCORE_MASK_KEY, "on")


def _parse_config_gib(options: Mapping | None, key: str, what: str) -> int | None:
    """`fused_kernel_options.<key>` (GiB > 0) in bytes, or None when absent/null."""
    value = None if options is None else options.get(key)
    if value is None:
        return None
    if not is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{CONFIG_PREFIX}.{key}={value!r} is not allowed; use a number of GiB > 0 ({what})")
    return max(1, int(value * 1024**3))


def parse_config_fused_loss_chunk(options: Mapping | None) -> int | None:
    """`fused_kernel_options.output_processor_fused_loss_chunk_gib` in bytes, or None when absent/null."""
    return _parse_config_gib(
        options,
        CONFIG_FUSED_LOSS_CHUNK_KEY,
        "the fused loss's chunk of stored logits, e.g. 2) or null (the op's default, 4",
    )


def parse_config_keep_logits(options: Mapping | None) -> int | None:
    """`fused_kernel_options.output_processor_keep_logits_gib` in bytes, or None when absent/null."""
    return _parse_config_gib(
        options,
        CONFIG_KEEP_LOGITS_KEY,
        "the logits the op keeps for its backward, e.g. 4) or null (none: recompute them",
    )


def edit_distance(a: str, b: str) -> int:
    """Single-letter insertions, deletions and substitutions that turn `a` into `b` (Levenshtein)."""
    previous = list(range(len(b) + 1))
    for i, letter in enumerate(a, 1):
        current = [i]
        for j, other in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (letter != other)))
        previous = current
    return previous[-1]


def check_known_keys(options: Mapping | None) -> None:
    """ValueError for a key of ours we do not know, or a near miss of one: a misspelt entry must not be ignored.

    verl's own keys of `fused_kernel_options` (e.g. impl_backend) are left alone."""
    for key in options or ():
        if not isinstance(key, str) or key in CONFIG_KEYS:
            continue
        if (
            key.startswith(CONFIG_NAMESPACE)
            or min(edit_distance(key, known) for known in CONFIG_KEYS) <= NEAR_MISS_EDITS
        ):
            nearest = difflib.get_close_matches(key, CONFIG_KEYS, n=1, cutoff=0)[0]  # most letters in common
            raise ValueError(
                f"{CONFIG_PREFIX}.{key} is not a verl_fused_hook entry; did you mean {CONFIG_PREFIX}.{nearest}? "
                f"allowed: {', '.join(CONFIG_KEYS)}"
            )


def resolve_plan(options: Mapping | None = None, environ: Mapping[str, str] | None = None) -> FusedForwardPlan:
    """Combine the environment and an engine's `fused_kernel_options` into one plan (see module docstring)."""
    check_known_keys(options)
    env_mode = parse_env(environ)
    config_mode = parse_config_mode(options)
    config_backend = parse_config_backend(options)
    fused_loss = parse_config_fused_loss(options)
    fused_loss_chunk = parse_config_fused_loss_chunk(options)
    score_mask = parse_config_score_mask(options)
    keep_logits = parse_config_keep_logits(options)
    batch_invariant = parse_config_batch_invariant(options)
    sampling_replay = parse_config_sampling_replay(options)
    replay_max_kept = parse_config_replay_max_kept(options)
    replay_reference = parse_config_replay_reference(options)

    notes = []
    if env_mode is not None:
        mode = env_mode
        source = f"{ENV_VAR}={'1' if env_mode == HOOK else '0'}"
        if config_mode is not None and config_mode != env_mode:
            notes.append(f"{ENV_VAR} overrides {CONFIG_PREFIX}.{CONFIG_HOOK_KEY}={config_mode == HOOK}")
    elif config_mode is not None:
        mode = config_mode
        source = f"{CONFIG_PREFIX}.{CONFIG_HOOK_KEY}={'true' if config_mode == HOOK else 'false'}"
    else:
        mode = UNSET
        source = f"{ENV_VAR} and {CONFIG_PREFIX}.{CONFIG_HOOK_KEY} unset"

    backend = None
    if mode == HOOK:
        backend = config_backend or DEFAULT_BACKEND
    elif config_backend is not None:
        notes.append(f"{CONFIG_PREFIX}.{CONFIG_BACKEND_KEY}={config_backend} ignored outside hook mode")
    if fused_loss and mode == HOOK and not backend_capabilities(backend).loss_inside:
        raise ValueError(
            f"{CONFIG_PREFIX}.{CONFIG_FUSED_LOSS_KEY}=true needs the op: "
            f"{CONFIG_PREFIX}.{CONFIG_BACKEND_KEY}={backend} "
            "runs a kernel that cannot take the loss inside; use output_processor_backend=auto"
        )
    if fused_loss and mode != HOOK:
        notes.append(f"{CONFIG_PREFIX}.{CONFIG_FUSED_LOSS_KEY}=true ignored outside hook mode")
    fused_loss = bool(fused_loss) and mode == HOOK
    if fused_loss_chunk is not None and not fused_loss:
        notes.append(f"{CONFIG_PREFIX}.{CONFIG_FUSED_LOSS_CHUNK_KEY} ignored: the fused loss is off")
    if score_mask is not None and mode != HOOK:
        notes.append(f"{CONFIG_PREFIX}.{CONFIG_SCORE_MASK_KEY} ignored outside hook mode")
    if keep_logits is not None and mode != HOOK:
        notes.append(f"{CONFIG_PREFIX}.{CONFIG_KEEP_LOGITS_KEY} ignored outside hook mode")
    if batch_invariant and mode != HOOK:
        notes.append(f"{CONFIG_PREFIX}.{CONFIG_BATCH_INVARIANT_KEY}=true ignored outside hook mode")
    if sampling_replay and mode != HOOK:
        notes.append(f"{CONFIG_PREFIX}.{CONFIG_REPLAY_KEY}=true ignored outside hook mode")
    if sampling_replay and mode == HOOK and not backend_capabilities(backend).selected_tokens:
        raise ValueError(
            f"{CONFIG_PREFIX}.{CONFIG_REPLAY_KEY}=true needs the op: {CONFIG_PREFIX}.{CONFIG_BACKEND_KEY}={backend} "
            "runs a kernel that cannot find or replay kept sets; use output_processor_backend=auto"
        )
    if replay_max_kept is not None and not (sampling_replay and mode == HOOK):
        notes.append(f"{CONFIG_PREFIX}.{CONFIG_REPLAY_MAX_KEPT_KEY} ignored: sampling replay is off")
    if replay_reference is not None and not (sampling_replay and mode == HOOK):
        notes.append(f"{CONFIG_PREFIX}.{CONFIG_REPLAY_REFERENCE_KEY} ignored: sampling replay is off")
    if keep_logits is not None and mode == HOOK and not backend_capabilities(backend).keep_logits:
        raise ValueError(
            f"{CONFIG_PREFIX}.{CONFIG_KEEP_LOGITS_KEY} needs a backend that keeps logits: "
            f"{CONFIG_PREFIX}.{CONFIG_BACKEND_KEY}={backend} recomputes them; use output_processor_backend=auto or "
            f"triton"
        )
    return FusedForwardPlan(
        mode=mode,
        backend=backend,
        source=source,
        note="; ".join(notes) or None,
        fused_loss=fused_loss,
        fused_loss_chunk_bytes=fused_loss_chunk if fused_loss else None,
        score_mask=score_mask is not False,
        keep_logits_bytes=keep_logits if keep_logits is not None and mode == HOOK else 0,
        batch_invariant=bool(batch_invariant) and mode == HOOK,
        sampling_replay=bool(sampling_replay) and mode == HOOK,
        replay_max_kept=replay_max_kept or DEFAULT_MAX_KEPT,
    )
