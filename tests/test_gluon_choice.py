"""Where the forward's partials run the warp-specialized Gluon kernel: Hopper with Triton >= 3.6 only, one log line
naming the reason elsewhere, nothing off CUDA. The GPU's compute capability is the one thing faked here (there is no
GPU on the CPU machine); the Gluon import is real."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton")

from verl_fused_hook.ops.backends import gluon_choice  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_choice():
    gluon_choice._for_cuda_device.cache_clear()
    gluon_choice.why_not_gluon.cache_clear()
    yield
    gluon_choice._for_cuda_device.cache_clear()
    gluon_choice.why_not_gluon.cache_clear()


def test_off_cuda_there_is_no_gluon_kernel_and_no_log_line(caplog):
    with caplog.at_level(logging.INFO, logger=gluon_choice.__name__):
        assert gluon_choice.gluon_forward_kernel(torch.device("cpu")) is None
    assert caplog.records == []


def test_a_gpu_other_than_hopper_runs_the_triton_kernel_and_says_why(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (10, 0))  # the faked GPU
    with caplog.at_level(logging.INFO, logger=gluon_choice.__name__):
        assert gluon_choice._for_cuda_device(0) is None
    assert len(caplog.records) == 1
    assert "compute capability 10.0" in caplog.text and "Triton's kernel" in caplog.text


def test_hopper_with_this_triton_gets_the_gluon_kernel(monkeypatch):
    import triton

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < gluon_choice.MIN_TRITON:
        pytest.skip(f"Triton {triton.__version__} predates the Gluon API the kernel uses")
    from verl_fused_hook.ops.backends import gluon_forward

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))  # the faked GPU
    assert gluon_choice._for_cuda_device(0) is gluon_forward


def test_doctor_names_the_forward_kernel_and_why(monkeypatch):
    from verl_fused_hook_harness.commands.doctor import forward_kernel_finding

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))  # the faked GPU
    finding = forward_kernel_finding(torch.device("cuda", 0))
    assert "Triton's forward_statistics_kernel" in finding.line() and "compute capability 8.0" in finding.line()
