"""scripts/sweep_forward_tiles.py on the CPU: its candidate forms and arguments, the launch layout it reports, its
tables naming the card, its profiler timeline, its default candidates compiled for sm_90, and (through Triton's
interpreter, test_triton_interpreter.py's named fakes) that its forward path with the op's tiles is the op's, bit
for bit, while other tiles and split layouts reach the forward launcher and give the same values. The timing itself
needs a GPU (issue 55)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_triton_interpreter import VALUE_TOL, _run_interpreted

from verl_fused_hook.ops.backends.triton_backend import FORWARD_CONFIG, TileConfig

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "sweep_forward_tiles.py"
SM_SHARED_BYTES = 233472  # an sm_90 SM's shared memory; each resident block also reserves 1 KiB of it


def _script():
    """The script as a module (scripts/ is no package)."""
    if "sweep_forward_tiles" not in sys.modules:
        spec = importlib.util.spec_from_file_location("sweep_forward_tiles", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
    return sys.modules["sweep_forward_tiles"]


def test_candidates_name_their_tiles_and_today_comes_first():
    s = _script()
    today = s.parse_candidate(s.DEFAULT_CANDIDATES[0])
    assert today == s.Candidate(FORWARD_CONFIG) and today.name == "128x256x64w8s3g16"
    for text in s.DEFAULT_CANDIDATES:
        assert s.parse_candidate(text).name == text
    assert len(set(s.DEFAULT_CANDIDATES)) == len(s.DEFAULT_CANDIDATES)
    two_per_sm = s.parse_candidate("128x128x64w4s3c2p9")
    assert two_per_sm == s.Candidate(TileConfig(128, 128, 64, FORWARD_CONFIG.group_m, 4, 3, 2), 9)
    assert two_per_sm.name == "128x128x64w4s3g16c2p9"
    assert s.parse_candidate(" 256x128x32w8s5g32c1 ").name == "256x128x32w8s5g32"


@pytest.mark.parametrize(
    "text",
    ["128x256x64w8", "128x256x64s3w8", "100x256x64w8s3", "128x256x8w8s3", "128x256x64w6s3", "128x256x64w8s0",
     "128x256x64w8s3g0", "128x256x64w8s3c0", "128x256x64w8s3p0", "128x256x64w8s3g16x", ""],
)  # fmt: skip
def test_a_malformed_candidate_is_refused(text):
    with pytest.raises(ValueError, match="expected|powers of two|>= 1"):
        _script().parse_candidate(text)


def test_arguments(capsys):
    s = _script()
    args = s.parse_arguments([])
    assert args.shapes == [
        (24576, 3584, 152064), (12288, 5120, 152064), (49152, 4096, 128256),
        (4096, 4096, 151936), (2048, 3584, 152064), (1024, 4096, 151936),
    ]  # fmt: skip
    assert [c.name for c in args.candidates] == list(s.DEFAULT_CANDIDATES)
    assert (args.warmup, args.repeats, args.calls, args.profile, args.out) == (1, 7, 1, False, None)
    args = s.parse_arguments(
        ["--shapes", "", "--candidates", "128x128x64w4s4,128x256x64w8s3g16p38", "--profile", "--out", "x.json"]
    )
    assert args.shapes == [] and args.profile and args.profile_shape == (1024, 4096, 151936)
    assert [c.name for c in args.candidates] == ["128x128x64w4s4g16", "128x256x64w8s3g16p38"]
    for bad, message in (
        (["--candidates", "128x256x64"], "--candidates: '128x256x64': expected"),
        (["--candidates", ","], "--candidates: none given"),
        (["--repeats", "0"], "--repeats, --calls"),
    ):
        with pytest.raises(SystemExit) as stopped:
            s.parse_arguments(bad)
        assert stopped.value.code == 2 and message in capsys.readouterr().err, bad
    with pytest.raises(SystemExit) as stopped:
        s.parse_arguments(["--help"])
    assert stopped.value.code == 0 and "--profile" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_main_needs_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        _script().main(["--shapes", "1024,4096,151936"])


def test_layout_is_the_ops_split_model_unless_a_candidate_fixes_it():
    """At N = 1024 over 151936 columns on 132 SMs the op splits 594 column tiles 33 ways of 18 (two waves of 132
    programs); p38 makes one wave of 128; two programs an SM halve the waves. At 49152 rows the op runs two launches
    (its per-tile partials bounded), the first of 28160 rows."""
    s = _script()
    today = s.parse_candidate("128x256x64w8s3g16")
    one_launch = {"launch_rows": 1024, "launches": 1}
    assert s.layout(1024, 151936, today, 132) == one_launch | {
        "per_split": 18, "splits": 33, "programs": 264, "waves": 2.0
    }  # fmt: skip
    fixed = s.layout(1024, 151936, s.parse_candidate("128x256x64w8s3g16p38"), 132)
    assert fixed == one_launch | {"per_split": 38, "splits": 16, "programs": 128, "waves": 128 / 132}
    assert s.layout(1024, 151936, s.parse_candidate("128x128x64w4s3g16c2"), 132)["waves"] == 1.0
    long = s.layout(49152, 151936, today, 132)
    assert (long["launch_rows"], long["launches"]) == (28160, 2)


def test_the_default_candidates_fit_hopper():
    """Each default candidate's forward kernel compiles for sm_90 (test_triton_compile_sm90.py's ahead-of-time
    compile, no GPU) within a block's shared memory, and its ctas_per_sm programs fit one SM's: a candidate that
    cannot launch wastes device time."""
    from test_triton_compile_sm90 import SHARED_LIMIT, _compile

    from verl_fused_hook.ops.backends import triton_kernels as kernels

    s = _script()
    for text in s.DEFAULT_CANDIDATES:
        c = s.parse_candidate(text).config
        signature = {
            "h_desc": f"tensordesc<bf16[{c.block_m}, {c.block_k}]>",
            "w_desc": f"tensordesc<bf16[{c.block_n}, {c.block_k}]>",
            "label_col_ptr": "*i32",
            **dict.fromkeys(["inv_temp_ptr", "parts_ptr"], "*fp32"),
            **dict.fromkeys(["store_desc", "tile_max_ptr", "group_max_desc"], "constexpr"),
            **dict.fromkeys(["rows", "H", "valid_columns", "num_col_tiles", "tiles_per_split", "num_splits"], "i32"),
        }
        constants = dict(
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, GROUP_M=c.group_m, ENTROPY=True, STORE=False,
            SQUARES=False, RAW=False, GROUP_N=16, store_desc=None, tile_max_ptr=None, group_max_desc=None,
        )  # fmt: skip
        compiled = _compile(kernels.forward_statistics_kernel, signature, constants, c.num_warps, c.num_stages)
        shared = compiled.metadata.shared
        assert 0 < shared <= SHARED_LIMIT and c.ctas_per_sm * (shared + 1024) <= SM_SHARED_BYTES, (text, shared)


def _report(device: str) -> dict:
    steps = {
        "one GEMM": {"ms": 2.0, "ratio": 1.0, "sm_clock_mhz": 1500.0, "power_w": 690.0, "cycles_ratio": 1.0},
        "one GEMM alone": {"ms": 2.2, "ratio": 1.1, "ratio_to_alone": 1.0},
        "op (bench's triton forward)": {"ms": 3.0, "ratio": 1.5, "ratio_to_alone": 3.0 / 2.2},
        "128x256x64w8s3g16": {
            "ms": 2.9, "ratio": 1.45, "per_split": 18, "splits": 33, "programs": 264, "waves": 2.0,
            "log_prob_max_abs": 0.0, "entropy_max_abs": 0.0,
        },
        "128x256x64w8s4g16": {"failed": "OutOfResources: out of resource: shared memory"},
    }  # fmt: skip
    return {
        "device": device, "sms": 132, "torch": "2.11", "triton": "3.6", "repeats": 7, "calls": 1,
        "candidates": ["128x256x64w8s3g16", "128x256x64w8s4g16"],
        "shapes": [{"N": 1024, "H": 4096, "V": 151936, "steps": steps}],
    }  # fmt: skip


def test_the_tables_name_the_card():
    s = _script()
    table = s.markdown(_report("NVIDIA H100 80GB HBM3"))
    titles = [line for line in table.splitlines() if line.startswith("#")]
    assert len(titles) == 2 and all("on NVIDIA H100 80GB HBM3" in line for line in titles), titles
    assert "| op (bench's triton forward) | 1.500x |" in table
    assert "| op (bench's triton forward) / one GEMM alone (3 back to back, at the power cap) | 1.364x |" in table
    assert "| 128x256x64w8s3g16 | 2.900 | 1.450x | - | - | 18 x 33 | 264 (2.00) | 0.00e+00 | 0.00e+00 |" in table
    assert "| 128x256x64w8s4g16 | failed: OutOfResources" in table
    assert "| one GEMM | 2.000 | 1.000x | 1500, 690 | 1.000x |" in table


def test_the_profile_timeline_orders_the_kernels_and_finds_the_gaps():
    """Fake profiler events (the script reads name, device type and time range): the GPU's first kernel 100 us
    after the call's first host op, a 5 us idle gap before the third kernel, one name called twice."""
    s = _script()
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(name, device, start, end):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [
        event("merge", cuda, 1200.0, 1210.0),
        event("aten::index_select", cpu, 0.0, 5.0),
        event("forward_statistics_kernel", cuda, 100.0, 1195.0),
        event("merge", cuda, 1215.0, 1220.0),
    ]
    timeline = s._gpu_timeline(SimpleNamespace(events=lambda: events))
    assert [k["name"] for k in timeline["kernels"]] == ["forward_statistics_kernel", "merge", "merge"]
    assert [k["gap_before_us"] for k in timeline["kernels"]] == [0.0, 5.0, 5.0]
    assert timeline["host_lead_us"] == 100.0 and timeline["span_us"] == 1120.0 and timeline["busy_us"] == 1110.0
    assert timeline["by_name"][0] == {"name": "forward_statistics_kernel", "calls": 1, "us": 1095.0}
    assert timeline["by_name"][1] == {"name": "merge", "calls": 2, "us": 15.0}


def _interpreted_sweep_path() -> dict:
    """Run in the subprocess: the script's forward with the op's tiles against the op itself (no grad), and with
    other tiles, pipelining and split layouts against fp64."""
    import test_triton_interpreter as interpreted

    from verl_fused_hook.ops import log_probs_and_entropy

    backend = interpreted._interpret_on_cpu()
    s = _script()
    g = torch.Generator().manual_seed(5)
    n, h, v = 70, 48, 150
    hidden = torch.randn(n, h, generator=g).half()
    weight = (torch.randn(v, h, generator=g) * 0.3).half()
    labels = torch.randint(0, v, (n,), generator=g)
    with torch.no_grad():
        op = log_probs_and_entropy(hidden, weight, labels, temperature=0.7, backend="triton")
    log_softmax = torch.log_softmax(hidden.double() @ weight.double().t() / 0.7, dim=1)
    reference = (log_softmax.gather(1, labels.unsqueeze(1)).squeeze(1), -(log_softmax.exp() * log_softmax).sum(1))
    today = s.sweep_forward(hidden, weight, labels, 0.7, s.Candidate(backend.FORWARD_CONFIG))
    cases = {"op": [(o - r).abs().max().item() for o, r in zip(op, reference)]}
    other = TileConfig(block_m=32, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=1, ctas_per_sm=2)
    # Other tiles add a logit's products in other groups: some bits move against the op, so the launch took them.
    # Other split layouts of those tiles keep every bit: each tile's partial is its own, merged in one order.
    moved, before = {}, op
    for label, candidate in (("other tiles", s.Candidate(other)), ("one tile a split", s.Candidate(other, 1)),
                             ("one split", s.Candidate(other, 10))):  # fmt: skip
        values = s.sweep_forward(hidden, weight, labels, 0.7, candidate)
        cases[label] = [(o - r).abs().max().item() for o, r in zip(values, reference)]
        cases[label + " layout"] = s.layout(n, v, candidate, backend.num_sms(None))
        moved[label] = not all(torch.equal(a, b) for a, b in zip(values, before))
        before = values if label == "other tiles" else before
    return {"same_bits_as_op": all(torch.equal(a, b) for a, b in zip(today, op)), "errors": cases, "moved": moved}


def test_the_sweeps_forward_is_the_ops_and_takes_other_tiles_in_the_interpreter():
    result = _run_interpreted("_interpreted_sweep_path", module=Path(__file__).stem)
    assert result["same_bits_as_op"] and result["moved"] == {
        "other tiles": True, "one tile a split": False, "one split": False
    }, result  # fmt: skip
    errors = result["errors"]
    for label in ("op", "other tiles", "one tile a split", "one split"):
        assert max(errors[label]) <= VALUE_TOL, (label, errors)
    # 150 columns in 16-wide tiles: 10 tiles, on 4 fake SMs x 2 programs
    assert errors["one tile a split layout"]["splits"] == 10 and errors["one split layout"]["splits"] == 1
    assert errors["other tiles layout"]["programs"] == 3 * errors["other tiles layout"]["splits"]
