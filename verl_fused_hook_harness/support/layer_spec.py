"""Which layer spec a model build uses (megatron-core's local spec or Transformer Engine's), and the options that
only Transformer Engine's spec takes: megatron's `batch_invariant_mode` and `gradient_accumulation_fusion`.

Why one module: verl builds models with Transformer Engine's layer spec only (Megatron-Bridge, or mbridge with
`vanilla_mbridge=True`); the
harness also builds on megatron-core's local spec (with its CPU attention stand-in), which is what runs on the CPU
and on a GPU without TE. ab-parity, e2e-bench, train-parity and doctor decide alike. Each decision is a function
of the machine's facts given as arguments (`choose_layer_spec`, `batch_invariant_refusal`,
`grad_accum_fusion_refusal`, `bridge_refusal`), so a test can hand it any facts; the facts (`transformer_engine`,
`flash_attention`, `apex_weight_gradient_fusion`, `megatron_bridge`) are read by importing the packages, once per
process. Nothing here imports
megatron-core at module level: the commands answer `--help` at once.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from dataclasses import dataclass

AUTO, LOCAL, TE = "auto", "local", "te"
LAYER_SPECS = (AUTO, LOCAL, TE)  # what --layer-spec takes
BUILT_SPECS = (LOCAL, TE)  # what a build uses (auto resolves to one of them)
# verl's two model builders: mbridge (`vanilla_mbridge=True`) and Megatron-Bridge (verl 0.9.1's default)
MBRIDGE, MEGATRON_BRIDGE = "mbridge", "megatron-bridge"
BRIDGES = (MBRIDGE, MEGATRON_BRIDGE)
BRIDGE_TRAINING_CONFIG = "megatron.bridge.training.config"

# What megatron-core 0.19.2 imports for FlashAttention 3 and 4 (transformer/attention.py): its batch_invariant_mode
# asserts attention_backend=flash and flash_attention_version 3 or 4 (TransformerConfig.__post_init__).
FLASH_ATTENTION_MODULES = {
    4: ("flash_attn.cute",),
    3: ("flash_attn_3.flash_attn_interface", "flashattn_hopper.flash_attn_interface"),
}
# TE's flash backend also runs FlashAttention 2 (megatron's batch_invariant_mode needs 3 or 4)
FLASH_ATTENTION_2_MODULE = "flash_attn.flash_attn_interface"
APEX_WEIGHT_GRADIENT_MODULE = "fused_weight_gradient_mlp_cuda"
VERL_MEGATRON_OVERRIDES = "actor_rollout_ref.actor.megatron.override_transformer_config"
# What was seen on the H200 (docs/benchmarks.md, "Transformer Engine (H200; H100 rows)"), for the refusals' words.
H200_FLASH_NOTE = (
    "on the H200 TransformerConfig(batch_invariant_mode=True) raised 'AssertionError: Batch invariant mode only "
    "supports FlashAttention (--attention-backend flash)'; FlashAttention is not installed there, has no wheel on "
    "PyPI (source only, its build outlasts a device call) and the machine has no network"
)
BATCH_INVARIANT_ALTERNATIVE = (
    "nearest working alternative: the op's own batch invariance with the decoder's output held fixed "
    "(tests/test_exact_on_policy.py)"
)


@dataclass(frozen=True)
class Presence:
    """Whether an optional package imports in this process: its version (or module), or why not."""

    importable: bool
    detail: str


@dataclass(frozen=True)
class FlashAttention:
    """The FlashAttention generation megatron-core would run (the newest that imports, as its auto order), or None."""

    version: int | None
    detail: str


@dataclass(frozen=True)
class SpecChoice:
    """The layer spec a build uses (LOCAL or TE) and why, in words for the log line and the report."""

    spec: str
    reason: str


class OptionRefused(ValueError):
    """An option this machine cannot honour; its message names the option, what is missing and the choices."""


def _import_failure(module: str) -> str | None:
    """None when `module` imports, else why not (the exception's type and message)."""
    try:
        importlib.import_module(module)
    except Exception as error:  # a missing package, a library it cannot load, a CUDA it cannot find: the reason
        return f"{type(error).__name__}: {error}"
    return None


def versioned_presence(modules: tuple[str, ...], package: str) -> Presence:
    """Whether every one of `modules` imports, with `package`'s `__version__` as the detail, else why the first
    that fails does not (naming it after the first, which a user installs by name)."""
    for position, module in enumerate(modules):
        failure = _import_failure(module)
        if failure is not None:
            return Presence(False, failure if position == 0 else f"{modules[0]} imports, {module} does not: {failure}")
    return Presence(True, str(getattr(importlib.import_module(package), "__version__", "version unknown")))


@functools.cache
def transformer_engine() -> Presence:
    """Transformer Engine's PyTorch part, as megatron-core's TE layers import it."""
    return versioned_presence(("transformer_engine.pytorch",), "transformer_engine")


@functools.cache
def flash_attention() -> FlashAttention:
    failures = []
    for version, modules in FLASH_ATTENTION_MODULES.items():
        for module in modules:
            failure = _import_failure(module)
            if failure is None:
                return FlashAttention(version, f"FlashAttention-{version} ({module})")
            failures.append(f"{module}: {failure}")
    return FlashAttention(None, "; ".join(failures))


@functools.cache
def te_flash_attention() -> Presence:
    """A FlashAttention that TE's flash backend runs (2, 3 or 4), the one verl's default attention_backend=flash
    leaves TE."""
    newer = flash_attention()
    if newer.version is not None:
        return Presence(True, newer.detail)
    failure = _import_failure(FLASH_ATTENTION_2_MODULE)
    if failure is None:
        return Presence(True, f"FlashAttention-2 ({FLASH_ATTENTION_2_MODULE})")
    return Presence(False, f"{newer.detail}; {FLASH_ATTENTION_2_MODULE}: {failure}")


@functools.cache
def megatron_bridge() -> Presence:
    """Megatron-Bridge, verl's default model builder: its package imports Transformer Engine, and the training
    config verl 0.9.1's make_megatron_module imports for the DDP config imports megatron-energon (the package
    alone imported on the H200 while the build stopped there)."""
    return versioned_presence(("megatron.bridge", BRIDGE_TRAINING_CONFIG), "megatron.bridge.package_info")


@functools.cache
def apex_weight_gradient_fusion() -> Presence:
    """apex's extension megatron-core's ColumnParallelLinear needs for gradient_accumulation_fusion."""
    failure = _import_failure(APEX_WEIGHT_GRADIENT_MODULE)
    return Presence(failure is None, APEX_WEIGHT_GRADIENT_MODULE if failure is None else failure)


def te_missing(*, cuda: bool, te: Presence) -> str | None:
    """Why Transformer Engine's layer spec cannot be built here, or None."""
    reasons = []
    if not cuda:
        reasons.append("no CUDA device (Transformer Engine's layers run on GPUs only)")
    if not te.importable:
        reasons.append(f"transformer_engine does not import ({te.detail})")
    return "; ".join(reasons) or None


def choose_layer_spec(requested: str, *, cuda: bool, te: Presence) -> SpecChoice:
    """The spec a build uses for `--layer-spec requested` given the facts: `auto` takes TE where it builds (CUDA and
    transformer_engine importable), else the local spec; `te` where it cannot build is refused (OptionRefused)."""
    if requested not in LAYER_SPECS:
        raise OptionRefused(f"--layer-spec {requested!r}: allowed {', '.join(LAYER_SPECS)}")
    if requested == LOCAL:
        return SpecChoice(LOCAL, "asked for (--layer-spec local)")
    missing = te_missing(cuda=cuda, te=te)
    if requested == TE:
        if missing:
            raise OptionRefused(
                f"--layer-spec te: Transformer Engine's layer spec cannot be built here: {missing}. Use --layer-spec "
                f"local (or auto, which takes te only where it builds); allowed: {', '.join(LAYER_SPECS)}"
            )
        return SpecChoice(TE, f"asked for (--layer-spec te); Transformer Engine {te.detail}")
    if missing:
        return SpecChoice(LOCAL, f"auto: {missing}")
    return SpecChoice(TE, f"auto: Transformer Engine {te.detail} imports and CUDA is here")


def batch_invariant_refusal(*, spec: str, te: Presence, flash: FlashAttention) -> str | None:
    """Why `--batch-invariant` cannot run here, or None: megatron-core's batch_invariant_mode runs on Transformer
    Engine's spec with FlashAttention 3 or 4 (its TransformerConfig asserts attention_backend=flash and
    flash_attention_version in (3, 4); TE runs the attention)."""
    missing = []
    if spec != TE:
        missing.append(f"the build uses the {spec} spec, not Transformer Engine's (--layer-spec te)")
    if not te.importable:
        missing.append(f"transformer_engine does not import ({te.detail})")
    if flash.version is None:
        missing.append(f"FlashAttention 3 or 4 does not import ({flash.detail})")
    if not missing:
        return None
    return (
        "--batch-invariant: megatron-core's batch_invariant_mode needs Transformer Engine's layer spec and "
        f"FlashAttention 3 or 4 (attention_backend=flash); missing here: {'; '.join(missing)}. "
        f"Seen: {H200_FLASH_NOTE}. Drop --batch-invariant; {BATCH_INVARIANT_ALTERNATIVE}"
    )


def grad_accum_fusion_refusal(*, spec: str, apex: Presence) -> str | None:
    """Why `--grad-accum-fusion` cannot run here, or None. Transformer Engine's layers fuse their weight gradients
    into megatron's `main_grad` themselves; megatron-core's ColumnParallelLinear, the output layer's class on either
    spec (TE's LM head only with MXFP8), raises at build without apex's fused_weight_gradient_mlp_cuda."""
    missing = []
    if spec != TE:
        missing.append(f"the build uses the {spec} spec, not Transformer Engine's (--layer-spec te)")
    if not apex.importable:
        missing.append(
            f"apex's {APEX_WEIGHT_GRADIENT_MODULE} does not import ({apex.detail}): megatron-core's "
            "ColumnParallelLinear (the output layer, on either spec) refuses gradient_accumulation_fusion without it"
        )
    if not missing:
        return None
    return f"--grad-accum-fusion: megatron's gradient_accumulation_fusion cannot run here: {'; '.join(missing)}"


def verl_default_build_gaps(*, bridge: Presence, apex: Presence, flash: Presence) -> list[str]:
    """What a TE build with verl 0.9.1's defaults needs beyond TE and this machine lacks, each with its way out (the
    caller asks only where TE imports). Both were seen on the H200 (docs/benchmarks.md, "Through
    Megatron-Bridge"):
    - verl's trainer config sets `attention_backend: flash` for either builder; megatron then turns TE's cuDNN and
      unfused attention off (NVTE_FUSED_ATTN=0, NVTE_UNFUSED_ATTN=0), so without a FlashAttention the first forward
      raises "No dot product attention backend is available";
    - Megatron-Bridge 0.6.2 turns gradient_accumulation_fusion on wherever TE imports, and megatron-core's
      ColumnParallelLinear (the output layer) raises at model build without apex's fused_weight_gradient_mlp_cuda."""
    gaps = []
    if not flash.importable:
        gaps.append(
            "verl's default attention_backend=flash leaves TE no attention without FlashAttention 2, 3 or 4 (the "
            f"first forward raises 'No dot product attention backend is available'; here: {flash.detail}): install "
            f"flash-attn, or set {VERL_MEGATRON_OVERRIDES}.attention_backend=fused (cuDNN's attention)"
        )
    if bridge.importable and not apex.importable:
        gaps.append(
            "Megatron-Bridge turns gradient_accumulation_fusion on where TE imports, and megatron-core's "
            f"ColumnParallelLinear (the output layer) then raises at model build without apex's "
            f"{APEX_WEIGHT_GRADIENT_MODULE} ({apex.detail}): install apex with its CUDA extensions, or set "
            f"+{VERL_MEGATRON_OVERRIDES}.gradient_accumulation_fusion=False"
        )
    return gaps


def bridge_refusal(*, bridge: str, spec: str, presence: Presence) -> str | None:
    """Why `--bridge BRIDGE` cannot build here, or None. mbridge builds anywhere the harness builds (on the local
    spec through stand_ins/local_spec_build.py); Megatron-Bridge builds Transformer Engine's spec only, and its
    package imports Transformer Engine."""
    if bridge not in BRIDGES:
        return f"--bridge {bridge!r}: allowed: {', '.join(BRIDGES)}"
    if bridge == MBRIDGE:
        return None
    missing = []
    if spec != TE:
        missing.append(
            f"the build uses the {spec} spec; Megatron-Bridge builds Transformer Engine's only (--layer-spec te)"
        )
    if not presence.importable:
        missing.append(
            f"Megatron-Bridge does not import ({presence.detail}); it needs Transformer Engine and megatron-energon"
        )
    if not missing:
        return None
    return (
        f"--bridge {MEGATRON_BRIDGE}: verl's default model builder cannot run here: {'; '.join(missing)}. "
        f"--bridge {MBRIDGE} builds through mbridge (verl's vanilla_mbridge=True)"
    )


def spec_overrides(*, batch_invariant: bool = False, grad_accum_fusion: bool = False) -> dict:
    """The TransformerConfig fields (verl's override_transformer_config) for the accepted options."""
    overrides = {}
    if batch_invariant:
        overrides.update(
            batch_invariant_mode=True, attention_backend="flash", flash_attention_version=flash_attention().version
        )
    if grad_accum_fusion:
        overrides["gradient_accumulation_fusion"] = True
    return overrides


def batch_invariant_kernels(on: bool):
    """Megatron's batch-invariant kernels (aten matmuls, log-softmax, mean and TE's RMSNorm replaced) for the block;
    the config field alone only pins the attention's splits."""
    if not on:
        return contextlib.nullcontext()
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import set_batch_invariant_mode

    return set_batch_invariant_mode(True)


# ---------------------------------------------------------------- the command line


def add_layer_spec_arguments(parser, *, batch_invariant: bool = True) -> None:
    """`--layer-spec` (and `--batch-invariant`) as every model-building command takes them."""
    parser.add_argument(
        "--layer-spec",
        choices=LAYER_SPECS,
        default=AUTO,
        help="the decoder's layers: te = Transformer Engine's spec, as verl builds through mbridge; local = "
        "megatron-core's local spec with the harness's attention; auto (default) = te where Transformer Engine "
        "imports on CUDA, else local",
    )
    if batch_invariant:
        parser.add_argument(
            "--batch-invariant",
            action="store_true",
            help="megatron's batch_invariant_mode (flash attention, batch-invariant kernels): needs --layer-spec te "
            "and FlashAttention 3 or 4; refused at start-up where they are missing",
        )


def padded_fp32_refusal(*, spec: str, layout: str, fp32: bool) -> str | None:
    """Why TE's layer spec cannot run the padded (BSHD) layout in fp32, or None where it can. Transformer Engine's
    limitation: it runs fp32 attention in its unfused backend only (its flash and cuDNN backends take fp16/bf16), and
    that backend's get_full_mask cannot take the padded attention mask verl's BSHD path passes. It fails in the
    decoder, before the output layer, so verl's path and hook mode alike (seen on the H100)."""
    if spec != TE or layout != "bshd" or not fp32:
        return None
    return (
        "--layout bshd in fp32 on Transformer Engine's layer spec: TE runs fp32 attention in its unfused backend only, "
        "and that backend's get_full_mask cannot take the padded attention mask verl passes (on the H100: 'The size "
        "of tensor a (14) must match the size of tensor b (4) at non-singleton dimension 2', in the decoder before "
        "the output layer, so verl's path and hook mode alike): Transformer Engine's limitation; use --dtype bf16 "
        "or --layer-spec local"
    )


def check_padded_fp32(parser, *, spec: str, layout: str, fp32: bool) -> None:
    """parser.error with the reason when TE's spec would be asked to run the padded layout in fp32."""
    refusal = padded_fp32_refusal(spec=spec, layout=layout, fp32=fp32)
    if refusal:
        parser.error(refusal)


def resolve_layer_spec(parser, requested: str, device: str) -> SpecChoice:
    """The spec for `requested` on `device`; parser.error with the reason where `te` cannot build."""
    te = transformer_engine() if requested != LOCAL else Presence(False, "not asked")
    try:
        return choose_layer_spec(requested, cuda=device == "cuda", te=te)
    except OptionRefused as error:
        parser.error(str(error))


def check_bridge(parser, bridge: str, spec: str) -> None:
    """parser.error with the reason when `--bridge megatron-bridge` cannot build here (mbridge always can)."""
    if bridge == MEGATRON_BRIDGE:
        refusal = bridge_refusal(bridge=bridge, spec=spec, presence=megatron_bridge())
        if refusal:
            parser.error(refusal)


def check_batch_invariant(parser, wanted: bool, spec: str) -> None:
    """parser.error with the reason when `--batch-invariant` is given and cannot run here."""
    if wanted:
        refusal = batch_invariant_refusal(spec=spec, te=transformer_engine(), flash=flash_attention())
        if refusal:
            parser.error(refusal)
