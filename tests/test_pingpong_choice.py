"""Which d_logits kernel the Triton backend's backward picks. The GPU's compute capability is a fake here
(monkeypatched torch.cuda.get_device_capability: this machine has no GPU); the Triton and Gluon imports are
the installed ones. On a real Hopper, tests/gpu/test_gluon_kernels.py checks the choice and the kernel."""

from __future__ import annotations

import logging

import pytest
import torch

from verl_fused_hook.ops import pingpong_choice


@pytest.fixture
def fake_capability(monkeypatch):
    pingpong_choice._for_cuda_device.cache_clear()
    yield lambda capability: monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    pingpong_choice._for_cuda_device.cache_clear()


def test_tensors_off_cuda_get_no_pingpong_kernel_and_no_log_line(caplog):
    with caplog.at_level(logging.INFO, logger=pingpong_choice.__name__):
        assert pingpong_choice.pingpong_kernels(torch.device("cpu")) is None
    assert caplog.records == []


def test_a_gpu_other_than_hopper_runs_the_triton_kernel_and_says_why(fake_capability, caplog):
    fake_capability((10, 0))
    with caplog.at_level(logging.INFO, logger=pingpong_choice.__name__):
        assert pingpong_choice.pingpong_kernels(torch.device("cuda", 0)) is None
        assert pingpong_choice.pingpong_kernels(torch.device("cuda", 0)) is None
    assert [r.getMessage() for r in caplog.records] == [
        "triton backend on cuda:0: the backward's d_logits run Triton's kernel, not the Gluon ping-pong kernel: "
        "compute capability 10.0 (it uses Hopper's wgmma)"
    ]


def test_an_older_triton_on_hopper_runs_the_triton_kernel_and_says_why(fake_capability, monkeypatch, caplog):
    import triton

    fake_capability((9, 0))
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    with caplog.at_level(logging.INFO, logger=pingpong_choice.__name__):
        assert pingpong_choice.pingpong_kernels(torch.device("cuda", 0)) is None
    assert "Triton 3.5.1 (it needs Triton >= 3.6's Gluon API)" in caplog.records[0].getMessage()


def test_hopper_with_this_triton_gets_the_gluon_kernel(fake_capability):
    import triton

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < pingpong_choice.MIN_TRITON:
        pytest.skip(f"Triton {triton.__version__} is older than the Gluon kernel needs")
    fake_capability((9, 0))
    from verl_fused_hook.ops import gluon_kernels

    assert pingpong_choice.pingpong_kernels(torch.device("cuda", 0)) is gluon_kernels
