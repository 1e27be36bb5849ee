"""e2e-bench's layer-spec options and their checks (`--layer-spec`, `--layer-specs local,te`, `--output-layer-share`,
`--grad-accum-fusion`, `--batch-invariant`); the step without the output layer, timed in the same rounds as the modes;
the table that sets each spec's times and the output layer's shares side by side.

Why: every earlier GPU figure ran megatron-core's local spec with the harness's attention, while verl builds
Transformer Engine's spec (its model bridges build no other). Timing both specs' models in one process, their
repeats in one set of rounds, keeps a drift of the GPU's clock from favouring either. The output layer's share of a
step is the step's time less the time of the same step without it, over the step: `DecoderOnlyStep` hands the model
the inputs hook mode's engine forward hands it (the runtime's `PackedLayout` over verl's THD packing) and, through
megatron's `output_processor` hook, takes the final norm's output as it is (no output weight, no log-softmax), then
backpropagates a mean of it. What it leaves out is the output layer, the log-probs' unpacking and the loss.
"""

from __future__ import annotations

import argparse

import torch

from verl_fused_hook.probe import unwrap_to_gpt
from verl_fused_hook.verl_integration.layouts import PackedLayout

from ...support.arguments import known_names
from ...support.layer_spec import (
    AUTO,
    BUILT_SPECS,
    add_layer_spec_arguments,
    apex_weight_gradient_fusion,
    check_batch_invariant,
    check_padded_fp32,
    grad_accum_fusion_refusal,
    resolve_layer_spec,
)
from ...support.reports import ms, on_device
from ...support.verl_engine import reset_fused_mode

DECODER_ONLY = "decoder only"
SPEC_KEY = "layer_spec"  # in a size's entry and its rows when a run compares specs


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """e2e-bench's layer-spec options: `--layer-spec`, `--batch-invariant` (as every model-building command takes
    them), `--layer-specs`, `--output-layer-share`, `--grad-accum-fusion`."""
    add_layer_spec_arguments(parser)
    parser.add_argument(
        "--layer-specs",
        default=None,
        metavar="SPECS",
        help=f"several layer specs in one run, comma-separated from {', '.join(BUILT_SPECS)}: a model per spec, "
        "their steps in the same rounds (instead of --layer-spec)",
    )
    parser.add_argument(
        "--output-layer-share",
        action="store_true",
        help="also time each step without the output layer (the decoder's output through a trivial output "
        "processor) and report the output layer's share of every mode's step (packed layout)",
    )
    parser.add_argument(
        "--grad-accum-fusion",
        action="store_true",
        help="megatron's gradient_accumulation_fusion, the model in megatron's DDP (fp32 main_grad): needs "
        "--layer-spec te and apex's fused_weight_gradient_mlp_cuda; refused at start-up without them",
    )


def resolve_specs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """args.layer_specs (the built specs, in run order) and args.layer_spec_reasons from --layer-spec/--layer-specs;
    the options only some specs take checked against them (parser.error naming the option otherwise)."""
    if args.layer_specs is not None and args.layer_spec != AUTO:
        parser.error("--layer-specs: give it or --layer-spec, not both")
    requested = known_names(parser, "--layer-specs", args.layer_specs, BUILT_SPECS) if args.layer_specs else []
    if args.layer_specs is not None and (not requested or len(set(requested)) < len(requested)):
        parser.error(f"--layer-specs: each of {', '.join(BUILT_SPECS)} at most once, at least one, got {requested}")
    choices = [resolve_layer_spec(parser, spec, args.device) for spec in requested or [args.layer_spec]]
    args.layer_specs = [choice.spec for choice in choices]
    args.layer_spec_reasons = {choice.spec: choice.reason for choice in choices}
    if len(choices) > 1 and (args.mtp or args.fused_loss or args.profile is not None):
        parser.error(
            "--layer-specs: several specs run the packed or padded modes; drop --mtp / --fused-loss / --profile"
        )
    if args.output_layer_share and (args.mtp or args.fused_loss or args.layout == "bshd"):
        parser.error("--output-layer-share: the packed layout's modes only; drop --mtp / --fused-loss / --layout bshd")
    for spec in args.layer_specs:
        check_batch_invariant(parser, args.batch_invariant, spec)
        check_padded_fp32(parser, spec=spec, layout=args.layout, fp32=args.dtype == torch.float32)
        if args.grad_accum_fusion:
            refusal = grad_accum_fusion_refusal(spec=spec, apex=apex_weight_gradient_fusion())
            if refusal:
                parser.error(refusal)
    if args.grad_accum_fusion and args.mtp:
        parser.error("--grad-accum-fusion: not with --mtp (its output-layer probe reads the bare model)")


def final_hidden_states(*, hidden_states: torch.Tensor, **_unused) -> torch.Tensor:
    """An output processor that returns the decoder's output (after the final norm) untouched."""
    return hidden_states


class DecoderOnlyStep:
    """Embedding, layers and final norm of one packed micro-batch, forward (and backward of a mean), no output layer."""

    def __init__(self, model, batch, pad_token_id: int):
        self.model = model
        input_ids = batch[0]
        self.layout = PackedLayout(
            unwrap_to_gpt(model), input_ids, input_ids.clone(), vision_model=False, pad_token_id=pad_token_id,
            cp_layout="zigzag", local_cp_size=None, pad_to_length_bucket=None, mtp=None,
        )  # fmt: skip

    def switch(self) -> None:
        """The model as megatron builds it: no verl patch, no plan (its forward is GPTModel.forward)."""
        reset_fused_mode(self.model)

    def forward(self) -> torch.Tensor:
        return self.model(**self.layout.model_inputs(), output_processor=final_hidden_states)

    def train(self) -> None:
        self.forward().float().mean().backward()


def output_layer_shares(entry: dict) -> None:
    """Each mode's row of `entry` gains the output layer's share of its step and of its no-grad forward: one less
    the decoder alone's time over the mode's (from the same rounds)."""
    decoder = entry.get("decoder_only")
    if not decoder or "train_s" not in decoder:
        return
    for row in entry["modes"]:
        if "train_s" in row:
            row["output_layer_share"] = {
                kind: 1 - decoder[f"{kind}_s"] / row[f"{kind}_s"] for kind in ("train", "forward")
            }


def _row(entry: dict, name: str) -> dict | None:
    return next((row for row in entry["modes"] if row["mode"] == name), None)


def _share(row: dict | None, kind: str) -> str:
    share = (row or {}).get("output_layer_share")
    return "" if share is None else f"{100 * share[kind]:.1f}%"


def _time(row: dict | None, kind: str) -> str:
    return "" if row is None or f"{kind}_s" not in row else ms(row[f"{kind}_s"])


def spec_table(report: dict) -> str:
    """Per size and mode: each spec's fwd+bwd and no-grad fwd time, the output layer's share of each where the decoder
    alone was timed, and te over local where both ran; then the decoder alone."""
    specs = report["layer_specs"]
    both = "local" in specs and "te" in specs
    header, rule = ["tokens", "mode"], ["---", "---"]
    for label in ("fwd+bwd", "no-grad fwd"):
        header += [f"{spec} {label}" for spec in specs] + [f"{spec} output layer share" for spec in specs]
        header += ["te / local"] if both else []
    rule += ["---"] * (len(header) - 2)
    lines = [
        f"Each layer spec's times per mode, and the output layer's share of them, {on_device(report)}:",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join(rule) + "|",
    ]
    sizes: dict[int, dict[str, dict]] = {}
    for entry in report["sizes"]:
        sizes.setdefault(entry["tokens"], {})[entry.get(SPEC_KEY, specs[0])] = entry
    for tokens, by_spec in sizes.items():
        names = list(dict.fromkeys(row["mode"] for entry in by_spec.values() for row in entry["modes"]))
        rows = {name: {spec: _row(entry, name) for spec, entry in by_spec.items()} for name in names}
        rows[DECODER_ONLY] = {spec: entry.get("decoder_only") for spec, entry in by_spec.items()}
        for name, per_spec in rows.items():
            if not any(per_spec.values()):
                continue
            cells = [f"{tokens:,}", name]
            for kind in ("train", "forward"):
                cells += [_time(per_spec.get(spec), kind) for spec in specs]
                cells += [_share(per_spec.get(spec), kind) for spec in specs]
                if both:
                    local, te = per_spec.get("local"), per_spec.get("te")
                    ratio = local and te and local.get(f"{kind}_s") and te.get(f"{kind}_s")
                    cells.append(f"{te[f'{kind}_s'] / local[f'{kind}_s']:.2f}x" if ratio else "")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
