"""The emulator build: kernels_cu/ compiled with the host C++ compiler into shared libraries that
run CUDA kernels on the CPU (`backends/emu.py` launches them).

Each unit's kernels are exported as `int symbol(const LaunchDims*, void** args)` (see
kernels_cu/emu/runtime.h), which runs every CUDA thread of a block as a real thread. Libraries are
built per set of units, several in parallel, and cached on disk like the cubins.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from paged.kernels.toolchain import host_compiler
from paged.kernels.toolchain.cache_dir import ArtifactCache
from paged.kernels.toolchain.source import MAIN_FILE, source_dir, source_hash
from paged.kernels.toolchain.specs import Unit

FLAGS = ("-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing", "-Wno-unknown-pragmas")

_CACHE = ArtifactCache("emu", ".so")
_BIN_CACHE = ArtifactCache("emu-bin", ".bin")
_loaded: dict[str, ctypes._CFuncPtr] = {}


class LaunchDims(ctypes.Structure):
    """The launch geometry every exported kernel takes (runtime.h's `LaunchDims`)."""

    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_ulonglong)]


def symbol(kernel: str) -> str:
    return "paged_emu_" + hashlib.sha1(kernel.encode()).hexdigest()[:16]


def translation_unit(units: Iterable[Unit], defines: Sequence[str] = ()) -> str:
    lines = [f"#define {d}" for d in defines] + [f'#include "{MAIN_FILE}"']
    lines += [f"PAGED_EMU_EXPORT({symbol(k)}, {k})" for unit in units for k in unit.kernels]
    return "\n".join(lines) + "\n"


def compile_shared_library(source: str, flags: Sequence[str] = FLAGS) -> Path:
    """Builds (or finds in the cache) a shared library from generated C++ `source`."""
    return _compile(source, flags, _CACHE)


def compile_executable(source: str, flags: Sequence[str]) -> Path:
    """Builds (or finds in the cache) a program, e.g. the ThreadSanitizer driver."""
    return _compile(source, flags, _BIN_CACHE)


def _compile(source: str, flags: Sequence[str], cache: ArtifactCache) -> Path:
    # `source` only includes paged.cu, so the kernel sources' hash keys what it compiles to.
    return host_compiler.build(cache, source, flags, include_dir=source_dir(), key_parts=[source_hash()])


def _load(units: list[Unit]) -> None:
    library = ctypes.CDLL(str(compile_shared_library(translation_unit(units))))
    for unit in units:
        for kernel in unit.kernels:
            fn = getattr(library, symbol(kernel))
            fn.argtypes = [ctypes.POINTER(LaunchDims), ctypes.POINTER(ctypes.c_void_p)]
            fn.restype = ctypes.c_int
            _loaded[kernel] = fn


def prepare(units: Iterable[Unit], jobs: int | None = None) -> None:
    """Builds and loads every unit not yet loaded, split over `jobs` parallel compiler runs."""
    missing = sorted({u for u in units if any(k not in _loaded for k in u.kernels)})
    if not missing:
        return
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(missing)))
    chunks = [missing[i::jobs] for i in range(jobs)]
    with ThreadPoolExecutor(jobs) as pool:
        for _ in pool.map(_load, chunks):
            pass


def kernel(name: str) -> ctypes._CFuncPtr:
    """The loaded entry point of a kernel whose unit `prepare` has loaded."""
    return _loaded[name]
