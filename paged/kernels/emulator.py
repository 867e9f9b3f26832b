"""CPU execution of the CUDA sources: kernels_cu/ built with the host C++ compiler and called on
CPU tensors through ctypes.

Each unit's kernels are exported as `int symbol(const LaunchDims*, void** args)` (see
kernels_cu/emu/runtime.h), which runs every CUDA thread of a block as a real thread. Libraries are
built per set of units, several in parallel, and cached on disk like the cubins.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from paged.kernels.cache_dir import ArtifactCache, make_key
from paged.kernels.host_compiler import find_compiler
from paged.kernels.launch import Launch, Ptr
from paged.kernels.source import MAIN_FILE, source_dir, source_hash
from paged.kernels.specs import Unit

FLAGS = ("-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing", "-Wno-unknown-pragmas")
# Same opt-in limit as an H100, so a launch the GPU would refuse fails here too.
MAX_SHARED_MEMORY = 227 * 1024
_STATUS = {1: "block size must be 1..1024 threads", 2: "grid dimensions must be positive"}

_CACHE = ArtifactCache("emu", ".so")
_BIN_CACHE = ArtifactCache("emu-bin", ".bin")
_LOCK = threading.Lock()  # the runtime's globals (gridDim, shared memory) hold one launch at a time
_loaded: dict[str, ctypes._CFuncPtr] = {}


class EmulatorBuildError(RuntimeError):
    """The host compiler rejected the kernel sources; the message holds its full output."""


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
    compiler = find_compiler()
    key = make_key(cache.kind, source_hash(), source, compiler.path, compiler.version, list(flags))
    hit = cache.get(key)
    if hit is not None:
        return hit[0]
    tu = cache.temp_path(".cpp")
    tu.write_text(source)
    out = cache.temp_path()
    cmd = [compiler.path, *flags, "-I", str(source_dir()), str(tu), "-o", str(out)]
    start = time.perf_counter()
    result = subprocess.run(cmd, capture_output=True, text=True)
    tu.unlink()
    if result.returncode != 0:
        out.unlink(missing_ok=True)
        raise EmulatorBuildError(f"{' '.join(cmd)} failed:\n{result.stderr}")
    return cache.put_file(key, out, {"compile_s": time.perf_counter() - start, "command": cmd})


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


class LaunchDims(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_ulonglong)]


def _c_value(arg: object) -> ctypes._SimpleCData:
    if isinstance(arg, Ptr):
        return ctypes.c_void_p(int(arg))
    if isinstance(arg, np.int32):
        return ctypes.c_int32(int(arg))
    if isinstance(arg, np.float32):
        return ctypes.c_float(float(arg))
    raise TypeError(f"unsupported kernel argument {arg!r} ({type(arg).__name__})")


def run(unit: Unit, launches: Sequence[Launch]) -> None:
    prepare([unit])
    with _LOCK:
        for launch in launches:
            values = [_c_value(a) for a in launch.args]
            args = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
            dims = LaunchDims((ctypes.c_uint * 3)(*launch.grid), (ctypes.c_uint * 3)(launch.block, 1, 1),
                              launch.shared_memory)
            status = _loaded[launch.kernel](ctypes.byref(dims), args)
            if status:
                raise RuntimeError(f"emulated launch of {launch.kernel} failed: {_STATUS.get(status, status)}")
