"""`verl-fused-hook doctor`: what the plugin will do on this machine, checked before a multi-hour job.

Why: a wrong version, a missing entry point or a misspelt config entry should
show up in a minute on the login node, not as a different code path hours
into a run. Each check prints one line (`ok`, `warn` or `FAIL`) and the exit
status is 1 when something would fail at start-up:

- versions: torch (>= 2.8), megatron-core (>= 0.19: the hook and what the MTP loss reads), verl (>= 0.9.1),
  mbridge; optional ones;
- hook probe: a tiny megatron-core GPTModel (CPU, its own process) built and run through
  `fused_output_processor`; its log-probs must equal the model's own logits path;
- device and backends: the GPU, which op backend `auto` picks for the job's hidden size and dtype,
  and why each other backend would not run;
- Transformer Engine and the layer spec: whether TE imports (its version, or why not; verl's engine builds
  TE's layer spec only, through Megatron-Bridge or mbridge) and which spec a model build uses here and why;
- bridge: whether Megatron-Bridge, verl's default model builder, imports;
- verl defaults: on a TE build, what verl's default config needs beyond TE (a FlashAttention for its
  attention_backend=flash; apex's weight-gradient extension where Megatron-Bridge turns on
  gradient_accumulation_fusion), each missing one with its way out;
- entry point: the `verl.plugins` entry as `import verl` sees it (and `VERL_USE_EXTERNAL_PLUGINS`);
- plan: the switch and `fused_kernel_options` resolved as the engine build will resolve them,
  from the environment and, when given, verl's Hydra config with overrides;
- sampling replay: with `output_processor_sampling_replay=true`, the composed config's rollout checked as the engine
  build checks it (truncation configured, processed log-probs, the bound at least top_k);
- op self-check: log-probs, entropy and both gradients against fp64 on the device at hand;
- batch invariance: with the ops' defaults, rows' log-probs and entropy alone and inside bigger batches (first, last,
  others masked) on the device at hand, compared bit for bit (exact on-policy training: docs/op.md).

Usage: verl-fused-hook doctor [--hidden-size H] [--dtype bf16|fp32] [--config-name NAME] [--verbose] [OVERRIDE ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.metadata
import importlib.util
import multiprocessing
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from packaging.version import Version

from verl_fused_hook import log_probs_and_entropy
from verl_fused_hook.ops import describe_backends
from verl_fused_hook.ops.backends.gluon_choice import why_not_gluon
from verl_fused_hook.switch import CONFIG_BATCH_INVARIANT_KEY, CONFIG_PREFIX, CONFIG_REPLAY_KEY, ENV_VAR, resolve_plan

from ..support.arguments import DTYPES
from ..support.layer_spec import (
    AUTO,
    Presence,
    apex_weight_gradient_fusion,
    choose_layer_spec,
    megatron_bridge,
    te_flash_attention,
    te_missing,
    transformer_engine,
    verl_default_build_gaps,
)
from ..support.reference import reference_log_probs_entropy, relative_error
from ..support.upstream_notices import UpstreamNotices, add_verbose_argument

OK, WARN, FAIL = "ok", "warn", "FAIL"
# (distribution, oldest supported, what needs it)
REQUIRED = (
    ("torch", "2.8", "verl 0.9.1's engine and distillation, and gloo's port 0 on the CPU"),
    ("megatron-core", "0.19", "the output_processor hook (0.18, PR 4686) and the MTP loss's config and logging (0.19)"),
    ("verl", "0.9.1", "the plugin's call sites"),
    ("mbridge", "0.15.1", "verl's model build (the plugin fixes its ModelType lookup on megatron-core >= 0.18)"),
)
OPTIONAL = ("triton", "transformer-engine", "liger-kernel")
ENTRY_POINT_GROUP, ENTRY_POINT_NAME = "verl.plugins", "verl_fused_hook"
PLUGIN_POLICY_ENV = "VERL_USE_EXTERNAL_PLUGINS"
# Self-check shape: a vocabulary that divides nothing, rows that do not fill a tile, a temperature other than 1.
SELF_CHECK = dict(rows=300, hidden=256, vocab=5003, temperature=0.7)
# fp32 inputs: fp32 rounding over the vocabulary. bf16 inputs (the GPU kernels' dtype): the outputs are still
# fp32-exact, the gradients carry bf16 rounding of d_logits (docs/op.md: <= 2.5e-3 relative).
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (5e-5, 5e-3)}
HOOK_PROBE_TOLERANCE = 1e-5
# Batch-invariance probe: rows computed alone, then among this many other rows (a count that fills no tile).
INVARIANCE_PROBE = dict(rows=77, others=(5, 1000), hidden=256, vocab=5003, temperature=0.7)


@dataclass(frozen=True)
class Finding:
    topic: str
    status: str
    text: str

    def line(self) -> str:
        return f"[{self.status:>4}] {self.topic:<14} {self.text}"


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions(version_of: Callable[[str], str | None] = _version) -> list[Finding]:
    findings = []
    for distribution, oldest, needed_by in REQUIRED:
        found = version_of(distribution)
        if found is None:
            findings.append(Finding(distribution, FAIL, f"not installed (>= {oldest} needed for {needed_by})"))
        elif Version(found) < Version(oldest):
            findings.append(Finding(distribution, FAIL, f"{found} is too old (>= {oldest} needed for {needed_by})"))
        else:
            findings.append(Finding(distribution, OK, f"{found} (>= {oldest})"))
    optional = ", ".join(f"{name} {version_of(name) or 'not installed'}" for name in OPTIONAL)
    findings.append(Finding("optional", OK, optional))
    return findings


def _hook_probe_in_this_process() -> Finding:
    """Build a tiny GPTModel on the CPU and compare the hook's log-probs with the model's own logits."""
    from verl_fused_hook import FusedOutputProcessorContext, fused_output_processor
    from verl_fused_hook.probe import OutputProcessorUnsupportedError, require_output_processor_support

    from ..stand_ins.megatron_cpu import build_cpu_gpt, init_model_parallel, tiny_transformer_config

    init_model_parallel(1)
    vocab = 97
    model = build_cpu_gpt(tiny_transformer_config(), vocab_size=vocab)
    try:
        require_output_processor_support(model)
    except OutputProcessorUnsupportedError as error:
        return Finding("hook probe", FAIL, str(error))
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (2, 11), generator=generator)
    labels = torch.randint(0, vocab, (2, 11), generator=generator)
    position_ids = torch.arange(11).expand(2, 11)
    with torch.no_grad():
        logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
        expected = torch.log_softmax(logits.double() / 0.7, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        output = model(
            input_ids=input_ids, position_ids=position_ids, attention_mask=None, labels=labels,
            output_processor=fused_output_processor,
            output_processor_context=FusedOutputProcessorContext(temperature=0.7),
        )  # fmt: skip
    error = (output.log_probs.double() - expected).abs().max().item()
    if error > HOOK_PROBE_TOLERANCE:
        return Finding("hook probe", FAIL, f"the hook's log-probs differ from the model's logits by {error:.2e}")
    return Finding(
        "hook probe", OK, f"GPTModel.forward calls fused_output_processor; log-probs match its logits ({error:.1e})"
    )


def check_hook_probe() -> Finding:
    """The probe in a fresh process: the CPU stand-ins it needs must not leak into this one. The process sees no
    GPU: megatron-core moves RoPE's frequencies to `torch.cuda.current_device()` whenever CUDA is there (on the
    H200 the CPU model's forward then failed with "found at least two devices, cuda:0 and cpu")."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        try:
            with _environment_of_new_processes(CUDA_VISIBLE_DEVICES=""):
                probe = pool.submit(_hook_probe_in_this_process)  # the worker starts here, with that environment
            return probe.result(timeout=600)
        except Exception as error:  # the probe's own failure is the finding
            return Finding("hook probe", FAIL, f"{type(error).__name__}: {error}")


@contextlib.contextmanager
def _environment_of_new_processes(**values: str):
    """os.environ with `values` while processes are started, then as it was (this process's CUDA is set up from
    the environment it read earlier, or reads it later, after the restore)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def check_device_and_backends(hidden_size: int, dtype: torch.dtype) -> list[Finding]:
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        major, minor = torch.cuda.get_device_capability(device)
        where = f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
    else:
        device, where = torch.device("cpu"), "no CUDA device: CPU only"
    reasons = describe_backends(
        torch.zeros(4, hidden_size, dtype=dtype, device=device), torch.zeros(8, hidden_size, dtype=dtype, device=device)
    )
    picked = reasons.pop("auto")
    others = "; ".join(f"{name}: {'runs' if reason is None else reason}" for name, reason in reasons.items())
    findings = [
        Finding("device", OK, where),
        Finding(
            "backends",
            OK,
            f"auto picks {picked} for {str(dtype).removeprefix('torch.')} H={hidden_size} on {device.type}; {others}",
        ),
    ]
    if picked == "triton":
        findings.append(forward_kernel_finding(device))
    return findings


def forward_kernel_finding(device: torch.device) -> Finding:
    """Which kernel computes the triton backend's forward here (the plain statistics, Σπ² and the top-k's kept fp32
    logits; the fused loss's fp16 kept logits are always Triton's): the warp-specialized Gluon one (Hopper) or
    Triton's, and why (the same bits per tile either way)."""
    reason = why_not_gluon(device.index)  # check_device_and_backends names the device's index
    if reason is None:
        return Finding(
            "forward kernel", OK, "the warp-specialized Gluon kernel (Hopper): a tile's softmax under the next GEMM"
        )
    return Finding("forward kernel", OK, f"Triton's forward_statistics_kernel, not the Gluon one: {reason}")


def layer_spec_findings(te: Presence, cuda: bool) -> list[Finding]:
    """The Transformer Engine and layer-spec lines for these facts (whether TE imports, whether CUDA is here)."""
    needed = (
        "verl's Megatron engine builds its models with TE's layer spec (Megatron-Bridge by default, mbridge with "
        "vanilla_mbridge=True: both build TE's spec only)"
    )
    if te.importable:
        te_line = Finding("TE", OK, f"Transformer Engine {te.detail} imports ({needed})")
    else:
        te_line = Finding(
            "TE", WARN, f"Transformer Engine does not import ({te.detail}): {needed}, so an engine build fails here"
        )
    choice = choose_layer_spec(AUTO, cuda=cuda, te=te)
    verl_build = "te (its model bridges build TE's spec only)" + (
        ", which cannot build here" if te_missing(cuda=cuda, te=te) else ""
    )
    text = f"verl's engine: {verl_build}; the harness's commands: {choice.spec} ({choice.reason})"
    return [te_line, Finding("layer spec", OK, text)]


def check_layer_spec() -> list[Finding]:
    return layer_spec_findings(transformer_engine(), torch.cuda.is_available())


def bridge_finding(bridge: Presence) -> Finding:
    """Whether verl's default model builder imports (verl 0.9.1: vanilla_mbridge=False builds through it)."""
    if bridge.importable:
        return Finding("bridge", OK, f"Megatron-Bridge {bridge.detail} imports (verl's default model builder)")
    return Finding(
        "bridge",
        WARN,
        f"Megatron-Bridge does not import ({bridge.detail}): verl's default builder (vanilla_mbridge=False) fails "
        "here; install megatron-bridge with what it imports (Transformer Engine, megatron-energon), or build "
        "through mbridge with actor_rollout_ref.actor.megatron.vanilla_mbridge=True",
    )


def verl_defaults_finding(te: Presence, bridge: Presence, apex: Presence, flash: Presence) -> Finding:
    """What a TE build with verl's default config needs beyond TE itself (layer_spec.verl_default_build_gaps)."""
    if not te.importable:
        return Finding("verl defaults", OK, "no TE build here (the TE line says why): nothing more to check")
    gaps = verl_default_build_gaps(bridge=bridge, apex=apex, flash=flash)
    if gaps:
        return Finding("verl defaults", WARN, "; ".join(gaps))
    fusion = f", apex {apex.detail} (Megatron-Bridge's gradient_accumulation_fusion)" if bridge.importable else ""
    return Finding("verl defaults", OK, f"attention_backend=flash runs {flash.detail}{fusion}")


def check_entry_point(entries: list | None = None) -> Finding:
    """`entries`: the installed `verl.plugins` entries named like ours (None: as importlib.metadata finds them)."""
    if entries is None:
        found = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        entries = [e for e in found if e.name == ENTRY_POINT_NAME]
    if not entries:
        spec = importlib.util.find_spec(ENTRY_POINT_NAME)
        where = (
            f"{ENTRY_POINT_NAME} imports from {os.path.dirname(os.path.dirname(spec.origin))} but is not installed "
            "there (a source tree on PYTHONPATH has no entry points)"
            if spec is not None and spec.origin
            else f"{ENTRY_POINT_NAME} does not import"
        )
        return Finding(
            "entry point",
            FAIL,
            f"no {ENTRY_POINT_GROUP} entry {ENTRY_POINT_NAME!r}: {where}; `import verl` will not load the plugin: "
            f"pip install the package into verl's environment, or set "
            f"actor_rollout_ref.model.external_lib={ENTRY_POINT_NAME}",
        )
    try:
        entries[0].load()
    except Exception as error:  # verl's loader would log this at DEBUG and go on without the plugin
        return Finding("entry point", FAIL, f"{entries[0].value} fails to import: {type(error).__name__}: {error}")
    policy = os.environ.get(PLUGIN_POLICY_ENV, "auto").strip().lower()
    allowed = policy == "auto" or ENTRY_POINT_NAME in {p.strip() for p in policy.split(",")}
    if not allowed:
        return Finding(
            "entry point",
            WARN,
            f"{PLUGIN_POLICY_ENV}={policy}: verl skips {ENTRY_POINT_NAME}; load it with "
            "actor_rollout_ref.model.external_lib=verl_fused_hook instead",
        )
    return Finding(
        "entry point",
        OK,
        f"{ENTRY_POINT_GROUP}: {ENTRY_POINT_NAME} = {entries[0].value} imports; "
        f"{PLUGIN_POLICY_ENV}={policy}: verl loads it in every process",
    )


def _composed_config(config_name: str | None, overrides: list[str]):
    """verl's trainer config composed as `python -m verl.trainer.main_ppo` composes it, or None without one."""
    if config_name is None and not overrides:
        return None
    import verl.trainer.main_ppo as main_ppo
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(main_ppo.__file__), "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name=config_name or "ppo_trainer", overrides=overrides)


def _fused_kernel_options(config_name: str | None, overrides: list[str]):
    config = _composed_config(config_name, overrides)
    return None if config is None else config.actor_rollout_ref.model.get("fused_kernel_options")


def check_plan(config_name: str | None, overrides: list[str]) -> Finding:
    try:
        options = _fused_kernel_options(config_name, overrides)
        plan = resolve_plan(options)
    except Exception as error:  # exactly what the engine build would raise
        return Finding("plan", FAIL, f"{type(error).__name__}: {error}")
    source = "the environment" if options is None else f"the environment and {CONFIG_PREFIX} of the composed config"
    return Finding(
        "plan", OK, f"from {source} ({ENV_VAR}={os.environ.get(ENV_VAR, 'unset')}): {plan.log_line('MegatronEngine')}"
    )


def check_sampling_replay(config_name: str | None, overrides: list[str]) -> Finding:
    """Sampling replay as the engine build will decide it: off, on with the rollout's truncation, or refused."""
    from verl_fused_hook.verl_integration.sampling_replay import replay_refusal, sampling_of_rollout_config

    try:
        config = _composed_config(config_name, overrides)
        options = None if config is None else config.actor_rollout_ref.model.get("fused_kernel_options")
        plan = resolve_plan(options)
    except Exception as error:  # the plan line says it
        return Finding("replay", WARN, f"not checked: the plan fails ({type(error).__name__})")
    if not plan.sampling_replay:
        return Finding("replay", OK, f"off ({CONFIG_PREFIX}.{CONFIG_REPLAY_KEY} not true in hook mode)")
    sampling = None if config is None else sampling_of_rollout_config(config.actor_rollout_ref.rollout)
    if sampling is None:
        return Finding("replay", WARN, "on; give the trainer config (overrides) to check the rollout's")
    reason = replay_refusal(plan, sampling)
    if reason is not None:
        return Finding("replay", FAIL, reason)
    return Finding(
        "replay",
        OK,
        f"on: log-probs renormalized over the rollout's kept sets (top_k={sampling.top_k}, top_p={sampling.top_p:g}, "
        f"at most {plan.replay_max_kept} ids per token)",
    )


def check_op(dtype: torch.dtype) -> Finding:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype if device == "cuda" else torch.float32
    shape = SELF_CHECK
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(shape["rows"], shape["hidden"], generator=generator).to(device, dtype)
    weight = (torch.randn(shape["vocab"], shape["hidden"], generator=generator) / shape["hidden"] ** 0.5).to(
        device, dtype
    )
    labels = torch.randint(0, shape["vocab"], (shape["rows"],), generator=generator).to(device)
    g_lp, g_ent = (torch.randn(shape["rows"], generator=generator).to(device) for _ in range(2))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_probs, entropy = log_probs_and_entropy(h, w, labels, temperature=shape["temperature"])
    torch.autograd.backward((log_probs, entropy), (g_lp, g_ent))
    ref_lp, ref_ent, ref_dh, ref_dw = reference_log_probs_entropy(
        hidden.cpu(),
        weight.cpu(),
        labels.cpu(),
        temperature=shape["temperature"],
        grad_outputs=(g_lp.cpu(), g_ent.cpu()),
    )
    value_error = max(
        (log_probs.cpu().double() - ref_lp).abs().max().item(), (entropy.cpu().double() - ref_ent).abs().max().item()
    )
    grad_error = max(relative_error(h.grad.cpu(), ref_dh), relative_error(w.grad.cpu(), ref_dw))
    value_tol, grad_tol = TOLERANCES[dtype]
    text = (
        f"{device} {str(dtype).removeprefix('torch.')} {shape['rows']}x{shape['hidden']}x{shape['vocab']}, T=0.7: "
        f"log-prob/entropy max error {value_error:.1e} (<= {value_tol:g}), gradients {grad_error:.1e} (<= {grad_tol:g})"
    )
    return Finding("op self-check", OK if value_error <= value_tol and grad_error <= grad_tol else FAIL, text)


def check_batch_invariance(dtype: torch.dtype) -> Finding:
    """With the op's defaults (no `batch_invariant`) the probe rows' values alone and inside batches must be the
    same bits: whatever micro-batch computes a sequence, its log-probs are the same (the PPO ratio of the first
    on-policy step is exactly 1). Where they are not (the portable backend on a GPU), the flag cannot help: it is
    refused there."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype if device == "cuda" else torch.float32
    shape = INVARIANCE_PROBE
    generator = torch.Generator().manual_seed(1)
    total = shape["rows"] + max(shape["others"])
    hidden = torch.randn(total, shape["hidden"], generator=generator).to(device, dtype)
    weight = (torch.randn(shape["vocab"], shape["hidden"], generator=generator) / shape["hidden"] ** 0.5).to(
        device, dtype
    )
    labels = torch.randint(0, shape["vocab"], (total,), generator=generator).to(device)
    probe = torch.arange(shape["rows"], device=device)

    def values(rows: torch.Tensor, where: slice, score_mask=None):
        with torch.no_grad():
            lp, ent = log_probs_and_entropy(
                hidden[rows],
                weight,
                labels[rows],
                temperature=shape["temperature"],
                score_mask=score_mask,
            )
        return lp[where], ent[where]

    alone = values(probe, slice(None))
    worst = 0.0
    for count in shape["others"]:
        others = torch.arange(shape["rows"], shape["rows"] + count, device=device)
        last = torch.cat([others, probe])
        mask = torch.ones(last.numel(), dtype=torch.bool, device=device)
        mask[:count:2] = False
        for lp, ent in (
            values(torch.cat([probe, others]), slice(0, shape["rows"])),
            values(last, slice(-shape["rows"], None)),
            values(last, slice(-shape["rows"], None), score_mask=mask),
        ):
            worst = max(worst, (lp - alone[0]).abs().max().item(), (ent - alone[1]).abs().max().item())
    backend = describe_backends(hidden, weight)["auto"]
    setting = f"{device} {str(dtype).removeprefix('torch.')}, backend {backend}, the ops' defaults"
    if worst == 0.0:
        return Finding(
            "invariance",
            OK,
            f"{setting}: {shape['rows']} rows alone and among {' and '.join(map(str, shape['others']))} others "
            f"(first, last, others masked): the same bits ({CONFIG_PREFIX}.{CONFIG_BATCH_INVARIANT_KEY}=true is not "
            "needed for them)",
        )
    return Finding(
        "invariance",
        WARN,
        f"{setting}: a row's values move by up to {worst:.1e} with the batch; exact on-policy training (the same "
        "log-probs whatever micro-batch computes them) does not hold on this device and backend (the Triton backend "
        "gives it on Hopper and newer GPUs)",
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=sys.argv[0], description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=4096, help="the model's hidden size, for the backend pick")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16", help="the model's dtype (default bf16)")
    parser.add_argument(
        "--config-name",
        default=None,
        help="verl trainer config to compose (default ppo_trainer when overrides are given)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides as on verl's command line, e.g. "
        "+actor_rollout_ref.model.fused_kernel_options.output_processor_fused_loss=true",
    )
    add_verbose_argument(parser)
    args = parser.parse_args(argv)
    if args.hidden_size < 1:
        parser.error(f"--hidden-size: must be >= 1, got {args.hidden_size}")
    dtype = DTYPES[args.dtype]
    with UpstreamNotices(verbose=args.verbose):
        findings = check_versions()
        findings.append(check_hook_probe())
        findings += check_device_and_backends(args.hidden_size, dtype)
        findings += check_layer_spec()
        findings.append(bridge_finding(megatron_bridge()))
        findings.append(
            verl_defaults_finding(
                transformer_engine(), megatron_bridge(), apex_weight_gradient_fusion(), te_flash_attention()
            )
        )
        findings.append(check_entry_point())
        findings.append(check_plan(args.config_name, args.overrides))
        findings.append(check_sampling_replay(args.config_name, args.overrides))
        findings.append(check_op(dtype))
        findings.append(check_batch_invariance(dtype))
    for finding in findings:
        print(finding.line(), flush=True)
    failed = [f.topic for f in findings if f.status == FAIL]
    print(
        f"doctor: {'FAIL: ' + ', '.join(failed) if failed else 'OK'} ({len(findings)} checks, "
        f"{sum(f.status == WARN for f in findings)} warnings)"
    )
    return 1 if failed else 0
