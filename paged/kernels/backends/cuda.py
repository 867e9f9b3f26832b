"""The cuda backend: kernels_cu/ compiled by NVRTC for the tensors' device, launched through
cuda.core on torch's current stream of that device; swaps are driver copies on the same stream.

cuda-python is imported where it is first needed, so this module (and the backend's support
declaration) loads on machines without it. `tests/fake_driver/` runs `CudaRunner` against a
recording stand-in for libcuda.so.1, so everything here executes in CI without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch

from paged.kernels.backends import launch
from paged.kernels.backends.v3_plans import DeviceLimits
from paged.kernels.toolchain import nvrtc
from paged.kernels.toolchain.specs import Unit

# What a block gets without opting in, static and dynamic shared memory together.
DEFAULT_SHARED_MEMORY = 48 * 1024
# Bytes the driver copies for each argument type the launch plans use (launch.Arg).
ARG_SIZES = {launch.Ptr: 8, np.int32: 4, np.float32: 4}
# The oldest NVIDIA driver branch that loads cubins of each CUDA major version.
DRIVER_BRANCHES = {12: "R525", 13: "R580"}
PACKAGES = "cuda-python, cuda-core and nvidia-cuda-nvrtc"

StreamSource = Callable[[int], Any]  # device index -> an object with __cuda_stream__


class CudaDriverError(RuntimeError):
    """The NVIDIA driver is missing, failed to start, or is too old for the cubins NVRTC builds."""


def _version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


@cache
def driver_version() -> int:
    """The driver's CUDA version (e.g. 13000), after checking that it loads NVRTC's cubins."""
    try:
        from cuda.bindings import driver

        (status,) = driver.cuInit(0)
        _, version = driver.cuDriverGetVersion()
    except Exception as e:  # the loader's error when libcuda.so.1 is absent
        raise CudaDriverError(
            f"the cuda backend needs the NVIDIA driver (libcuda.so.1), which could not be loaded: {e}; "
            f"{PACKAGES} come from pip, the driver does not"
        ) from e
    if status != driver.CUresult.CUDA_SUCCESS:
        raise CudaDriverError(f"the NVIDIA driver failed to initialise: {status!r}")
    major, minor = nvrtc.toolchain().version
    if version < major * 1000:
        branch = DRIVER_BRANCHES.get(major, "a newer one")
        raise CudaDriverError(
            f"the NVIDIA driver supports CUDA {_version_text(version)}, but NVRTC {major}.{minor} (pip package "
            f"nvidia-cuda-nvrtc, used with cuda-python) builds CUDA {major} cubins, which need a driver for CUDA "
            f"{major}.0 or newer (NVIDIA {branch} or newer): upgrade the driver, or run with kernel.backend=torch"
        )
    return version


def torch_stream(index: int) -> torch.cuda.Stream:
    return torch.cuda.current_stream(index)


@dataclass
class _Kernel:
    """A loaded kernel and what the driver says about it."""

    handle: Any  # cuda.core.Kernel
    static_smem: int
    param_sizes: tuple[int, ...]
    dynamic_smem_limit: int  # raised by the opt-in attribute, never lowered


class CudaRunner:
    """One device's kernel table and streams; units compile (or load from the cache) on first use.

    Launches go to the stream `stream_source(index)` names (torch's current stream of the device by
    default), wrapped once per stream handle. The caller's current context (torch's current device)
    is the same after every call as before it.
    """

    # Swaps are cuMemcpyAsync on the stream; from pageable memory they would block the host.
    needs_pinned_host = True

    def __init__(self, index: int, stream_source: StreamSource = torch_stream) -> None:
        driver_version()
        from cuda.core import Device

        self.index = index
        self.device = Device(index)
        self._stream_source = stream_source
        major, minor = self.device.compute_capability
        self.arch = f"sm_{major}{minor}"
        if self.arch not in nvrtc.supported_archs():
            raise CudaDriverError(
                f"NVRTC {'.'.join(map(str, nvrtc.toolchain().version))} cannot build for device {index} "
                f"({self.arch}); it supports {', '.join(nvrtc.supported_archs())}: upgrade nvidia-cuda-nvrtc"
            )
        properties = self.device.properties
        self.max_shared_memory = int(properties.max_shared_memory_per_block_optin)
        self.limits = DeviceLimits(int(properties.multiprocessor_count),
                                   int(properties.max_shared_memory_per_multiprocessor),
                                   int(properties.max_threads_per_multiprocessor),
                                   int(properties.max_registers_per_multiprocessor))
        self._kernels: dict[str, _Kernel] = {}
        self._configs: dict[tuple[Any, ...], Any] = {}
        self._streams: dict[int, Any] = {}
        self._context: int | None = None  # this device's primary context, once it was made current

    @contextmanager
    def _current(self) -> Iterator[None]:
        """This device's context current for the block, the caller's restored after it. Launches run
        once per layer, so when this device is already current nothing is switched."""
        from cuda.bindings import driver

        _, previous = driver.cuCtxGetCurrent()
        if self._context is not None and int(previous) == self._context:
            yield
            return
        self.device.set_current()
        self._context = int(driver.cuCtxGetCurrent()[1])
        try:
            yield
        finally:
            driver.cuCtxSetCurrent(previous)

    def _load(self, unit: Unit) -> None:
        from cuda.core import ObjectCode

        compiled = nvrtc.compile_unit(unit, self.arch)
        module = ObjectCode.from_cubin(compiled.cubin, symbol_mapping=compiled.symbol_mapping)
        for name in unit.kernels:
            kernel = module.get_kernel(name)
            static = int(kernel.attributes[self.device].shared_size_bytes)
            sizes = tuple(int(info.size) for info in kernel.arguments_info)
            self._kernels[name] = _Kernel(kernel, static, sizes, DEFAULT_SHARED_MEMORY - static)

    def _kernel(self, unit: Unit, name: str) -> _Kernel:
        if name not in self._kernels:
            with self._current():
                self._load(unit)
        return self._kernels[name]

    def dynamic_shared_memory_limit(self, unit: Unit, kernel: str) -> int:
        """The most dynamic shared memory `kernel` may ask for: the device's opt-in maximum less
        what the kernel declares statically."""
        return self.max_shared_memory - self._kernel(unit, kernel).static_smem

    def _stream(self) -> Any:
        foreign = self._stream_source(self.index)
        handle = int(foreign.__cuda_stream__()[1])
        if handle not in self._streams:
            self._streams[handle] = self.device.create_stream(foreign)
        return self._streams[handle]

    def _check(self, kernel: _Kernel, item: launch.Launch) -> None:
        sizes = tuple(ARG_SIZES[type(a)] for a in item.args)
        if sizes != kernel.param_sizes:
            raise RuntimeError(
                f"launch plan of {item.kernel} passes arguments of {sizes} bytes; the kernel takes {kernel.param_sizes}"
            )
        if item.shared_memory + kernel.static_smem > self.max_shared_memory:
            raise ValueError(
                f"{item.kernel} needs {item.shared_memory} bytes of dynamic and {kernel.static_smem} of static shared "
                f"memory; device {self.index} allows {self.max_shared_memory} per block"
            )

    def _allow_shared_memory(self, kernel: _Kernel, needed: int) -> None:
        """Opts a kernel into more dynamic shared memory than the 48 KB default leaves it."""
        if needed <= kernel.dynamic_smem_limit:
            return
        from cuda.bindings import driver

        (err,) = driver.cuKernelSetAttribute(
            driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, needed,
            kernel.handle.handle, driver.CUdevice(self.index),
        )
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cannot raise a kernel's dynamic shared memory to {needed} bytes: {err!r}")
        kernel.dynamic_smem_limit = needed

    def _config(self, kernel: _Kernel, item: launch.Launch) -> Any:
        """The checked `LaunchConfig` of a launch shape: a decode step launches the same shapes in
        every layer, so each is checked and built once, not once per launch."""
        key = (item.kernel, item.grid, item.block, item.shared_memory, tuple(map(type, item.args)))
        config = self._configs.get(key)
        if config is None:
            from cuda.core import LaunchConfig

            self._check(kernel, item)
            self._allow_shared_memory(kernel, item.shared_memory)
            config = self._configs[key] = LaunchConfig(grid=item.grid, block=item.block, shmem_size=item.shared_memory)
        return config

    def run(self, unit: Unit, launches: Sequence[launch.Launch]) -> None:
        from cuda.core import launch as cuda_launch

        kernels = [self._kernel(unit, item.kernel) for item in launches]
        with self._current():
            configs = [self._config(kernel, item) for kernel, item in zip(kernels, launches)]
            stream = self._stream()
            for kernel, item, config in zip(kernels, launches, configs):
                args = [int(a) if isinstance(a, launch.Ptr) else a for a in item.args]
                cuda_launch(stream, config, kernel.handle, *args)

    def copy(self, copies: Sequence[launch.Copy]) -> None:
        """One cuMemcpyAsync per copy on the stream, as vLLM's swap_blocks: the driver tells
        host-to-device, device-to-host and device-to-device apart by the (unified) addresses."""
        from cuda.bindings import driver

        with self._current():
            stream = self._stream().handle
            for item in copies:
                (err,) = driver.cuMemcpyAsync(int(item.dst), int(item.src), item.nbytes, stream)
                if err != driver.CUresult.CUDA_SUCCESS:
                    raise RuntimeError(f"cuMemcpyAsync of {item.nbytes} bytes from {item.src:#x} to {item.dst:#x} "
                                       f"failed: {err!r}")


class CudaBackend(launch.RunnerBackend):
    name = "cuda"
    description = "CUDA kernels compiled by NVRTC"
    device_type = "cuda"

    def __init__(self) -> None:
        self._runners: dict[int, CudaRunner] = {}

    def runner(self, tensor: torch.Tensor) -> CudaRunner:
        return self._runner(tensor.device)

    def _runner(self, device: torch.device) -> CudaRunner:
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._runners:
            self._runners[index] = CudaRunner(index)
        return self._runners[index]

    def device_limits(self, device: torch.device) -> DeviceLimits:
        return self._runner(device).limits

    def unavailable_reason(self) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        try:
            nvrtc.toolchain()
            driver_version()
        except (nvrtc.NVRTCUnavailableError, CudaDriverError) as e:
            return str(e)
        return None


BACKEND = CudaBackend()
