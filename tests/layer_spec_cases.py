"""The layer specs a GPU test that builds a model runs on, each named: megatron-core's local spec everywhere,
Transformer Engine's where TE imports (skipped with the reason elsewhere).

Why: `--layer-spec auto` takes TE's spec wherever TE imports, so a test that left the spec to `auto` tested another
model on a machine with TE than without it (issue 56: the fp32 BSHD case ran TE's attention there)."""

from __future__ import annotations

import pytest

from verl_fused_hook_harness.support.layer_spec import LOCAL, TE, transformer_engine

_TE = transformer_engine()
NEEDS_TE = pytest.mark.skipif(
    not _TE.importable, reason=f"Transformer Engine's layer spec: transformer_engine does not import ({_TE.detail})"
)
BOTH_SPECS = (pytest.param(LOCAL, id=LOCAL), pytest.param(TE, id=TE, marks=NEEDS_TE))
