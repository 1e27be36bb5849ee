"""Let mbridge 0.15.1 build models on megatron-core >= 0.18.

Why: mbridge's `get_model` compares the model type against
`ModelType.encoder_and_decoder`, a member megatron-core 0.18 removed, so every
model build raises AttributeError (fixed upstream only in an unreleased
commit). mbridge only ever compares against that member, so giving its module
a `ModelType` namespace whose `encoder_and_decoder` equals nothing restores the
decoder-only path it takes anyway. megatron-core's enum itself is untouched.
"""

from __future__ import annotations

import logging
import types

from ..log_once import note

logger = logging.getLogger(__name__)

REMOVED_MEMBER = "encoder_and_decoder"


class _NeverEqual:
    """Stands in for the removed enum member: no model type ever equals it."""

    def __eq__(self, other):
        return False

    def __ne__(self, other):
        return True

    __hash__ = object.__hash__

    def __repr__(self):
        return "<ModelType.encoder_and_decoder: removed in megatron-core 0.18>"


def needs_fix(util_module) -> bool:
    model_type = getattr(util_module, "ModelType", None)
    return model_type is not None and not hasattr(model_type, REMOVED_MEMBER)


def apply(util_module) -> bool:
    """Give `mbridge.core.util` a ModelType with the removed member; True when applied (idempotent)."""
    if not needs_fix(util_module):
        return False
    enum_type = util_module.ModelType
    members = {member.name: member for member in enum_type}
    util_module.ModelType = types.SimpleNamespace(**members, **{REMOVED_MEMBER: _NeverEqual()})
    note(
        logger,
        "verl_fused_hook: mbridge.core.util.ModelType lacks %s on this megatron-core; "
        "gave mbridge's get_model a stand-in so decoder-only models build",
        REMOVED_MEMBER,
    )
    return True
