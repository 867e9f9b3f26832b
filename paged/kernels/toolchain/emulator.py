"""The emulator build: kernels_cu/ compiled with the host C++ compiler into shared libraries that
run CUDA kernels on the CPU (`backends/emu.py` launches them).

Each unit's kernels are exported as `int symbol(const LaunchDims*, void** args)` (see
kernels_cu/emu/runtime.h), which runs every CUDA thread of a block as a fiber (emu/fibers.h).
Libraries are built per set of units, several in parallel, and cached on disk like the cubins.
Every library starts from the same text (all of paged.cu), so that part is compiled once per
source hash into a precompiled header and each library compiles only its own instantiations
(about 1.1 s of a 2.2 s build of one unit on a 2-core EPYC).
"""

from __future__ import annotations

import ctypes
import functools
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
# g++ takes `X.gch` for `-include X`; the stub `X` beside it includes the sources, so a header g++
# finds unusable (another compiler build, say) still compiles, only slower.
_PCH_CACHE = ArtifactCache("emu-pch", ".h.gch")
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
    # The header is compiled before `source`, so a source defining macros first must not use it.
    prefix = _precompiled_header(tuple(flags), source_dir(), source_hash()) if source.startswith(_PCH_TEXT) else None
    return host_compiler.build(_CACHE, source, flags, include_dir=source_dir(), key_parts=[source_hash()],
                               prefix_header=prefix)


_PCH_TEXT = f'#include "{MAIN_FILE}"\n'


@functools.cache  # per process: the cache lookup hashes the ~60 MB header
def _precompiled_header(flags: tuple[str, ...], include_dir: Path, digest: str) -> Path:
    """The stub whose `.gch` holds paged.cu (of `include_dir`, hashing to `digest`) compiled with `flags`."""
    gch = host_compiler.build(_PCH_CACHE, _PCH_TEXT, (*flags, "-x", "c++-header"), include_dir=include_dir,
                              key_parts=[digest])
    stub = gch.with_suffix("")
    if not stub.is_file():
        written = _PCH_CACHE.temp_path(".h")
        written.write_text(_PCH_TEXT)
        os.replace(written, stub)
    return stub


def compile_executable(source: str, flags: Sequence[str]) -> Path:
    """Builds (or finds in the cache) a program, e.g. the ThreadSanitizer driver."""
    # `source` only includes paged.cu, so the kernel sources' hash keys what it compiles to.
    return host_compiler.build(_BIN_CACHE, source, flags, include_dir=source_dir(), key_parts=[source_hash()])


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
