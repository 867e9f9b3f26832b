"""The emu backend: the CUDA kernels of kernels_cu/ executed on the CPU, a block's CUDA threads as
fibers of the calling thread (built by `toolchain/emulator.py`). Slow; it exists to test the CUDA
sources without a GPU."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import numpy as np
import torch

from paged.kernels.backends.launch import RunnerBackend
from paged.kernels.backends.launch_api import BoundPart, Copy, Launch, Ptr, Relaunches
from paged.kernels.toolchain import emulator, host_compiler
from paged.kernels.toolchain.specs import Unit
from paged.kernels.v3_layout import H100, DeviceLimits

# Same opt-in limit as an H100, so a launch the GPU would refuse fails here too.
MAX_SHARED_MEMORY = 227 * 1024
_STATUS = {1: "block size must be 1..1024 threads", 2: "grid dimensions must be positive"}
_LOCK = threading.Lock()  # the runtime's globals (gridDim, shared memory) hold one launch at a time


def _c_value(arg: object) -> ctypes._SimpleCData:
    if isinstance(arg, Ptr):
        return ctypes.c_void_p(int(arg))
    if isinstance(arg, np.int32):
        return ctypes.c_int32(int(arg))
    if isinstance(arg, np.float32):
        return ctypes.c_float(float(arg))
    raise TypeError(f"unsupported kernel argument {arg!r} ({type(arg).__name__})")


class EmuRunner:
    # Copies are synchronous memcpy.
    needs_pinned_host = False

    def dynamic_shared_memory_limit(self, unit: Unit, kernel: str) -> int:
        # The emulator's __shared__ arrays are statics outside the launch's buffer.
        return MAX_SHARED_MEMORY

    def run(self, unit: Unit, launches: Sequence[Launch]) -> None:
        emulator.prepare([unit])
        with _LOCK:
            for launch in launches:
                values = [_c_value(a) for a in launch.args]
                args = (ctypes.c_void_p * len(values))(
                    *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values]
                )
                dims = emulator.LaunchDims(
                    (ctypes.c_uint * 3)(*launch.grid), (ctypes.c_uint * 3)(launch.block, 1, 1), launch.shared_memory
                )
                status = emulator.kernel(launch.kernel)(ctypes.byref(dims), args)
                if status:
                    raise RuntimeError(f"emulated launch of {launch.kernel} failed: {_STATUS.get(status, status)}")

    def bind(self, parts: Sequence[BoundPart]) -> Relaunches:
        return Relaunches(self, parts)

    def copy(self, copies: Sequence[Copy]) -> None:
        for item in copies:
            ctypes.memmove(item.dst, item.src, item.nbytes)


RUNNER = EmuRunner()


class EmuBackend(RunnerBackend):
    """The CUDA kernels on CPU tensors: decode, prefill and the cache ops, as the cuda backend
    launches them."""

    name = "emu"
    description = "CUDA kernels emulated on the CPU"
    device_type = "cpu"

    def runner(self, tensor: torch.Tensor) -> EmuRunner:
        return RUNNER

    def device_limits(self, device: torch.device) -> DeviceLimits:
        """An H100's: v3 plans the splits and pipeline an H100 would run."""
        return H100

    def unavailable_reason(self) -> str | None:
        return host_compiler.unavailable_reason()


BACKEND = EmuBackend()
