"""The cuda backend: kernels_cu/ compiled by NVRTC for the tensors' device, loaded through
cuda.core and launched with `cuLaunchKernel` on torch's current stream of that device; swaps are
driver copies on the same stream.

A launch costs a few µs of host: each kernel's argument types are checked at its first launch and
it gets a parameter block the driver reads through a fixed `void**`, so a launch is one
`struct.pack_into` of its arguments and one driver call; shared memory is checked only past what
the kernel was already allowed (`python experiments/host_overhead.py` measures it). Launches a model
repeats layer after layer are bound (`CudaRunner.bind`): packed once, each into a block of its own,
so a later layer writes only its tensors' addresses before the driver call.

cuda-python is imported where it is first needed, so this module (and the backend's support
declaration) loads on machines without it. `tests/fake_driver/` runs `CudaRunner` against a
recording stand-in for libcuda.so.1, so everything here executes in CI without a GPU.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import torch

from paged.kernels.backends import launch
from paged.kernels.backends.launch_api import BoundPart
from paged.kernels.toolchain import nvrtc
from paged.kernels.toolchain.specs import Unit
from paged.kernels.v3_layout import DeviceLimits

# What a block gets without opting in, static and dynamic shared memory together.
DEFAULT_SHARED_MEMORY = 48 * 1024
# Bytes the driver copies for each argument type the launch plans use (launch.Arg), and the
# `struct` code that writes one into its 8-byte slot of a parameter block.
ARG_SIZES = {launch.Ptr: 8, np.int32: 4, np.float32: 4}
ARG_CODES = {launch.Ptr: "Q", np.int32: "i4x", np.float32: "f4x"}
SLOT_BYTES = 8
# The oldest NVIDIA driver branch that loads cubins of each CUDA major version.
DRIVER_BRANCHES = {12: "R525", 13: "R580"}
PACKAGES = "cuda-python, cuda-core and nvidia-cuda-nvrtc"

StreamSource = Callable[[int], int]  # device index -> the raw handle of the stream to launch on


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


def torch_stream(index: int) -> int:
    """torch's current stream of device `index` as its raw handle, read as torch.compile's generated
    code reads it (`torch.cuda.current_stream` makes a Stream object at every launch); through the
    public call where a torch build lacks the private one (CPU builds do)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


class _ParamBlock:
    """A parameter block: one 8-byte slot per argument (`slots`, a ctypes array; `view`, its bytes)
    and the `void**` array at address `params` that points at the slots, which `cuLaunchKernel`
    reads (and copies during the call)."""

    def __init__(self, n: int) -> None:
        self.slots = (ctypes.c_uint64 * n)()
        self.pointers = (ctypes.c_void_p * n)(*(ctypes.addressof(self.slots) + SLOT_BYTES * i for i in range(n)))
        self.view = memoryview(self.slots).cast("B")
        self.params = ctypes.addressof(self.pointers)


@dataclass
class _Kernel:
    """A loaded kernel, what the driver says about it, and its parameter block, into which `packer`
    writes a launch's arguments. The driver copies the parameters during `cuLaunchKernel`, so one
    block serves every launch (a runner launches from one thread, its executor's). The block is
    made, and the plan's argument types checked against the kernel's parameters, at the kernel's
    first launch: a plan passes the same types to a kernel every time."""

    handle: Any  # cuda.core.Kernel
    static_smem: int
    param_sizes: tuple[int, ...]
    dynamic_smem_limit: int  # raised by the opt-in attribute, never lowered
    function: Any = None  # driver.CUfunction: the CUkernel, which cuLaunchKernel takes in the current context
    packer: struct.Struct | None = None
    block: _ParamBlock | None = field(default=None, repr=False)

    def prepare(self, item: launch.Launch, driver: Any) -> None:
        self.block = _ParamBlock(len(item.args))
        self.packer = struct.Struct("<" + "".join(ARG_CODES[type(a)] for a in item.args))
        self.function = driver.CUfunction(int(self.handle.handle))

    def packed(self, item: launch.Launch) -> _ParamBlock:
        """`item`'s arguments in a block of their own (the kernel's own block is rewritten at
        every launch)."""
        assert self.packer is not None, "a kernel is prepared at its first check"
        block = _ParamBlock(len(item.args))
        self.packer.pack_into(block.view, 0, *item.args)
        return block


def _refused(item: launch.Launch, err: Any) -> None:
    raise RuntimeError(f"cuLaunchKernel of {item.kernel} (grid {item.grid}, block {item.block}, "
                       f"{item.shared_memory} bytes of shared memory) failed: {err!r}")


class _BoundLaunches:
    """`CudaRunner.bind`'s launches, each with its arguments packed once into a block of its own: a
    call writes each block's changed pointers (slot i takes `addresses[j]` for each (i, j) of its
    slots) and launches it on the caller's current stream, in this device's context."""

    def __init__(self, runner: CudaRunner, kernels: Sequence[_Kernel], parts: Sequence[BoundPart]) -> None:
        self.runner = runner
        self.blocks = [kernel.packed(item) for kernel, (_, item, _) in zip(kernels, parts, strict=True)]
        self.items = [(item, block.slots, tuple(changed), kernel.function, *item.grid, item.block,
                       item.shared_memory, block.params)
                      for kernel, (_, item, changed), block in zip(kernels, parts, self.blocks, strict=True)]

    def __call__(self, addresses: Sequence[int]) -> None:
        runner = self.runner
        if not runner._is_current():
            with runner._current():
                self(addresses)
            return
        driver = runner._driver
        launch_kernel, stream = driver.cuLaunchKernel, runner._stream()
        for item, slots, changed, function, gx, gy, gz, block, shared_memory, params in self.items:
            for i, j in changed:
                slots[i] = addresses[j]
            (err,) = launch_kernel(function, gx, gy, gz, block, 1, 1, shared_memory, stream, params, 0)
            if err != driver.CUresult.CUDA_SUCCESS:
                _refused(item, err)


class CudaRunner:
    """One device's kernel table and streams; units compile (or load from the cache) on first use.

    Launches go to the stream `stream_source(index)` names (torch's current stream of the device by
    default) by its raw handle, for which the driver's `CUstream` is made once. The caller's current
    context (torch's current device) is the same after every call as before it.
    """

    # Swaps are cuMemcpyAsync on the stream; from pageable memory they would block the host.
    needs_pinned_host = True

    def __init__(self, index: int, stream_source: StreamSource = torch_stream) -> None:
        driver_version()
        from cuda.bindings import driver
        from cuda.core import Device

        # held here: an import statement in the launch path costs more than the launch
        self._driver = driver
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
        self._streams: dict[int, Any] = {}  # raw handle -> driver.CUstream
        self._context: int | None = None  # this device's primary context, once it was made current

    def _is_current(self) -> bool:
        return self._context is not None and int(self._driver.cuCtxGetCurrent()[1]) == self._context

    @contextmanager
    def _current(self) -> Iterator[None]:
        """This device's context current for the block, the caller's restored after it. Launches run
        once per layer, so when this device is already current nothing is switched."""
        _, previous = self._driver.cuCtxGetCurrent()
        if self._context is not None and int(previous) == self._context:
            yield
            return
        self.device.set_current()
        self._context = int(self._driver.cuCtxGetCurrent()[1])
        try:
            yield
        finally:
            self._driver.cuCtxSetCurrent(previous)

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
        """The caller's current stream, as the driver's handle."""
        handle = self._stream_source(self.index)
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = self._driver.CUstream(handle)
        return stream

    def _check_arguments(self, kernel: _Kernel, item: launch.Launch) -> None:
        sizes = tuple(ARG_SIZES[type(a)] for a in item.args)
        if sizes != kernel.param_sizes:
            raise RuntimeError(
                f"launch plan of {item.kernel} passes arguments of {sizes} bytes; the kernel takes {kernel.param_sizes}"
            )

    def _check_shared_memory(self, kernel: _Kernel, item: launch.Launch) -> None:
        """Past what the kernel may use now: checked against the device, then opted into."""
        if item.shared_memory + kernel.static_smem > self.max_shared_memory:
            raise ValueError(
                f"{item.kernel} needs {item.shared_memory} bytes of dynamic and {kernel.static_smem} of static shared "
                f"memory; device {self.index} allows {self.max_shared_memory} per block"
            )
        self._allow_shared_memory(kernel, item.shared_memory)

    def _allow_shared_memory(self, kernel: _Kernel, needed: int) -> None:
        """Opts a kernel into more dynamic shared memory than the 48 KB default leaves it."""
        if needed <= kernel.dynamic_smem_limit:
            return
        driver = self._driver
        (err,) = driver.cuKernelSetAttribute(
            driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, needed,
            kernel.handle.handle, driver.CUdevice(self.index),
        )
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cannot raise a kernel's dynamic shared memory to {needed} bytes: {err!r}")
        kernel.dynamic_smem_limit = needed

    def run(self, unit: Unit, launches: Sequence[launch.Launch]) -> None:
        for item in launches:
            if item.kernel not in self._kernels:
                self._kernel(unit, item.kernel)
        if self._is_current():
            self._launch(launches)
            return
        with self._current():
            self._launch(launches)

    def _launch(self, launches: Sequence[launch.Launch]) -> None:
        driver = self._driver
        stream = self._stream()
        for item in launches:
            kernel = self._checked(item)
            kernel.packer.pack_into(kernel.block.view, 0, *item.args)
            # grid and block are the driver's to check (it refuses a bad one with CUDA_ERROR_INVALID_VALUE)
            (err,) = driver.cuLaunchKernel(kernel.function, *item.grid, item.block, 1, 1, item.shared_memory, stream,
                                           kernel.block.params, 0)
            if err != driver.CUresult.CUDA_SUCCESS:
                _refused(item, err)

    def _checked(self, item: launch.Launch) -> _Kernel:
        """`item`'s kernel, its arguments checked at its first launch and its shared memory allowed."""
        kernel = self._kernels[item.kernel]
        if kernel.packer is None:
            self._check_arguments(kernel, item)
            kernel.prepare(item, self._driver)
        if item.shared_memory > kernel.dynamic_smem_limit:
            self._check_shared_memory(kernel, item)
        return kernel

    def bind(self, parts: Sequence[BoundPart]) -> _BoundLaunches:
        """The parts' launches packed once, each into a block of its own: a call writes only the
        changed pointers and launches (issue 43's ≤ 5 µs a launch: no `Launch`, no full repack)."""
        for unit, item, _ in parts:
            self._kernel(unit, item.kernel)
        with self._current():
            kernels = [self._checked(item) for _, item, _ in parts]
        return _BoundLaunches(self, kernels, parts)

    def copy(self, copies: Sequence[launch.Copy]) -> None:
        """One cuMemcpyAsync per copy on the stream, as vLLM's swap_blocks: the driver tells
        host-to-device, device-to-host and device-to-device apart by the (unified) addresses."""
        driver = self._driver
        with self._current():
            stream = self._stream()
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

    def has_mma(self, device: torch.device) -> bool:
        return int(self._runner(device).arch.removeprefix("sm_")) >= 80

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
