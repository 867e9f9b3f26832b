"""Backends are objects that declare what they support; `resolve_backend` picks one per device and
shape for `auto`, says why, and refuses a named backend that cannot serve the configuration."""

from __future__ import annotations

import logging

import pytest
import torch

from paged import kernels
from paged.kernels.backends import cpu as cpu_backend
from paged.kernels.backends.cuda import CudaBackend
from paged.kernels.testing import AttentionCase, attention_inputs
from paged.kernels.toolchain import host_compiler

pytestmark = pytest.mark.compiles

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def resolve(requested: str, device: torch.device = CPU, head_size: int = 64, block_size: int = 16,
            partition_size: int | None = 512) -> tuple[kernels.KernelBackend, str]:
    return kernels.resolve_backend(requested, device=device, dtype=torch.float16, head_size=head_size,
                                   block_size=block_size, partition_size=partition_size)


@pytest.fixture
def cuda_runs_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolution only consults declarations and availability, so no GPU is needed to test it."""
    monkeypatch.setattr(CudaBackend, "unavailable_reason", lambda self: None)


@pytest.fixture
def cpu_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_backend, "_load_failure", lambda: None)


def test_backends_are_looked_up_by_name_and_declare_their_support() -> None:
    torch_backend, cpu, cuda, emu = (kernels.get_backend(n) for n in ("torch", "cpu", "cuda", "emu"))
    assert kernels.BACKENDS == ("torch", "cpu", "cuda", "emu")
    assert (torch_backend.device_type, torch_backend.head_sizes, torch_backend.block_sizes) == (None, None, None)
    assert (cpu.device_type, cpu.head_sizes, cpu.block_sizes) == ("cpu", None, (8, 16, 32))
    assert cuda.device_type == "cuda" and emu.device_type == "cpu"
    assert cuda.head_sizes == emu.head_sizes == (64, 80, 96, 112, 128, 256)
    assert kernels.get_backend(cpu) is cpu


def test_ops_take_a_backend_object_as_well_as_a_name() -> None:
    x = attention_inputs(AttentionCase(torch.float32, 64, 16, 2, 2, 32, (5, 40)))
    args = (x.query, x.clean_key_cache, x.clean_value_cache, x.block_tables, x.seq_lens, x.scale)
    by_object = kernels.paged_attention(*args, backend=kernels.get_backend("torch"))
    assert torch.equal(by_object, kernels.paged_attention(*args, backend="torch"))


def test_auto_picks_cpu_for_tensors_on_the_cpu(cpu_builds: None, cuda_runs_here: None) -> None:
    backend, reason = resolve("auto")
    assert backend.name == "cpu"
    assert reason == "cpu (native C++/OpenMP; auto: backend='cuda' needs cuda tensors, got tensors on cpu)"


def test_auto_picks_cuda_for_a_native_shape_on_a_cuda_device(cuda_runs_here: None) -> None:
    backend, reason = resolve("auto", CUDA)
    assert backend.name == "cuda" and reason == "cuda (CUDA kernels compiled by NVRTC; auto)"


def test_auto_falls_back_to_torch_for_a_head_size_the_native_kernels_lack(
    cuda_runs_here: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="paged.kernels"):
        backend, reason = resolve("auto", CUDA, head_size=32)
    assert backend.name == "torch"
    assert "head_size=32 is not supported by backend='cuda'; supported: 64, 80, 96, 112, 128, 256" in reason
    assert "backend='cpu' needs cpu tensors, got tensors on cuda" in reason
    assert reason in caplog.text


def test_auto_falls_back_to_torch_when_the_cpu_library_does_not_build(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise host_compiler.HostBuildError("g++ said no")

    monkeypatch.setattr(cpu_backend, "load", broken)
    cpu_backend._load_failure.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="paged.kernels"):
            backend, reason = resolve("auto")
    finally:
        cpu_backend._load_failure.cache_clear()
    assert backend.name == "torch"
    assert "backend='cpu' cannot run here: g++ said no" in reason
    assert "native cpu attention unavailable: g++ said no" in caplog.text


@pytest.mark.parametrize(
    ("requested", "device", "head", "block", "partition", "message"),
    [
        ("emu", CUDA, 64, 16, 512, "backend='emu' needs cpu tensors, got tensors on cuda"),
        ("cuda", CUDA, 32, 16, 512, "head_size=32 is not supported by backend='cuda'; supported: 64, 80, 96, 112"),
        ("cpu", CPU, 64, 12, 512, "block_size=12 is not supported by backend='cpu'; supported: 8, 16, 32"),
        ("emu", CPU, 64, 16, 48, "partition_size=48 is not supported by backend='emu'; supported: 32, 64, 128"),
        ("rocm", CPU, 64, 16, 512, "backend='rocm' is not supported; allowed: torch, cpu, cuda, emu"),
    ],
)
def test_a_named_backend_that_cannot_serve_the_model_is_refused(
    cuda_runs_here: None, requested: str, device: torch.device, head: int, block: int, partition: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        resolve(requested, device, head, block, partition)


def test_v2_partition_limits_only_apply_when_v2_can_run(cuda_runs_here: None) -> None:
    assert resolve("cuda", CUDA, partition_size=None)[0].name == "cuda"
    with pytest.raises(ValueError, match="partition_size=48"):
        resolve("cuda", CUDA, partition_size=48)
