"""Keep the hook alive through verl's MTP `_postprocess` patch, or stop at build.

Why: verl's `mtp_patch.patch_postprocess` replaces `GPTModel._postprocess` with
a version that accepts `output_processor` but never calls it, so a hook-mode
forward would get logits back instead of log-probs. verl applies it in two
cases: MTP training (where verl already turns fused kernels off, so no
hook-mode model meets it) and forward-only engines whose MTP layers were
overridden to 0. Without MTP layers megatron-core's own `_postprocess` (kept
by verl as `_postprocess_backup`) does everything verl's does plus the hook,
so hook calls go there. With MTP layers verl's patch also rescales the MTP
loss in ways megatron-core's does not, so routing around it would change the
loss: we refuse at build time instead.
"""

from __future__ import annotations

import functools

from ..probe import unwrap_to_gpt
from ..switch import ENV_VAR
from .model_plan import in_hook_mode


class HookMtpConflictError(RuntimeError):
    """Hook mode met verl's MTP _postprocess patch on a model with MTP layers."""


def make_patch_postprocess(original):
    """Wrap verl's `patch_postprocess` so hook-mode models keep their output_processor."""

    @functools.wraps(original)
    def patch_postprocess(model):
        if not in_hook_mode(model):
            return original(model)
        gpt = unwrap_to_gpt(model)
        if gpt.config.mtp_num_layers:
            raise HookMtpConflictError(
                f"hook mode cannot run through verl's MTP _postprocess patch on a model with "
                f"mtp_num_layers={gpt.config.mtp_num_layers}: verl's patch drops the output_processor and rescales the "
                f"MTP loss itself. Set {ENV_VAR}=0 (verl's legacy fused forward) or disable MTP "
                "(actor_rollout_ref.model.mtp.enable=False)"
            )
        original(model)
        patched, megatron_own = gpt._postprocess, gpt._postprocess_backup

        @functools.wraps(patched)
        def postprocess_keeping_hook(*args, output_processor=None, output_processor_context=None, **kwargs):
            if output_processor is None:
                return patched(*args, **kwargs)
            return megatron_own(
                *args, output_processor=output_processor, output_processor_context=output_processor_context, **kwargs
            )

        gpt._postprocess = postprocess_keeping_hook

    return patch_postprocess
