"""The cuda backend: kernels_cu/ compiled by NVRTC for the tensors' device, launched through
cuda.core on torch's current stream of that device.

cuda-python is imported where it is first needed, so this module (and the backend's support
declaration) loads on machines without it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from paged.kernels.backends import launch
from paged.kernels.toolchain import nvrtc
from paged.kernels.toolchain.specs import Unit

DEFAULT_SHARED_MEMORY = 48 * 1024


class _CudaRunner:
    """Per-device kernel table; units compile (or load from the cache) on first use."""

    def __init__(self, index: int) -> None:
        from cuda.core import Device

        self.device = Device(index)
        self.device.set_current()
        major, minor = torch.cuda.get_device_capability(index)
        self.arch = f"sm_{major}{minor}"
        self.max_shared_memory = int(self.device.properties.max_shared_memory_per_block_optin)
        self._kernels: dict[str, Any] = {}
        self._smem_limit: dict[str, int] = {}

    def _load(self, unit: Unit) -> None:
        from cuda.core import ObjectCode

        compiled = nvrtc.compile_unit(unit, self.arch)
        module = ObjectCode.from_cubin(compiled.cubin, symbol_mapping=compiled.symbol_mapping)
        for name in unit.kernels:
            self._kernels[name] = module.get_kernel(name)
            self._smem_limit[name] = DEFAULT_SHARED_MEMORY

    def _allow_shared_memory(self, name: str, needed: int) -> None:
        """Opts a kernel into more than 48 KB of dynamic shared memory; the limit only ever rises."""
        if needed <= self._smem_limit[name]:
            return
        from cuda.bindings import driver

        (err,) = driver.cuKernelSetAttribute(
            driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, needed,
            self._kernels[name].handle, driver.CUdevice(self.device.device_id),
        )
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cannot raise {name}'s dynamic shared memory to {needed} bytes: {err}")
        self._smem_limit[name] = needed

    def run(self, unit: Unit, launches: Sequence[launch.Launch]) -> None:
        from cuda.core import LaunchConfig
        from cuda.core import launch as cuda_launch

        self.device.set_current()
        if any(name not in self._kernels for name in unit.kernels):
            self._load(unit)
        # This device's stream, whichever device torch has current.
        stream = torch.cuda.current_stream(self.device.device_id)
        for item in launches:
            self._allow_shared_memory(item.kernel, item.shared_memory)
            config = LaunchConfig(grid=item.grid, block=item.block, shmem_size=item.shared_memory)
            args = [int(a) if isinstance(a, launch.Ptr) else a for a in item.args]
            cuda_launch(stream, config, self._kernels[item.kernel], *args)


class CudaBackend(launch.RunnerBackend):
    name = "cuda"
    description = "CUDA kernels compiled by NVRTC"
    device_type = "cuda"

    def __init__(self) -> None:
        self._runners: dict[int, _CudaRunner] = {}

    def runner(self, tensor: torch.Tensor) -> _CudaRunner:
        index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        if index not in self._runners:
            self._runners[index] = _CudaRunner(index)
        return self._runners[index]

    def unavailable_reason(self) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device"
        try:
            nvrtc.toolchain()
        except nvrtc.NVRTCUnavailableError as e:
            return str(e)
        return None


BACKEND = CudaBackend()
