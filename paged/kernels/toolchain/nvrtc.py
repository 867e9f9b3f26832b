"""Compiling kernels_cu/ to cubin with NVRTC through cuda.core, with an on-disk cache.

Works without a GPU or driver: cubins for any supported sm_XX can be built on a CPU machine
(PTX would need the driver in cuda.core 1.2). One Program per `Unit`, so a run compiles only the
instantiations it launches. Headers come from the nvidia-cuda-runtime wheel via cuda-pathfinder.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from paged.kernels.toolchain.cache_dir import ArtifactCache, make_key
from paged.kernels.toolchain.source import MAIN_FILE, device_source_hash, main_source, source_dir
from paged.kernels.toolchain.specs import Unit

PIP_HINT = "pip install nvidia-cuda-nvrtc nvidia-cuda-runtime cuda-python"
_CACHE = ArtifactCache("cubin", ".cubin")


class NVRTCUnavailableError(RuntimeError):
    """NVRTC or the CUDA headers cannot be found."""


class KernelCompileError(RuntimeError):
    """NVRTC rejected the sources; the message carries the full compilation log."""


@dataclass(frozen=True)
class Toolchain:
    program: Any
    program_options: Any
    include_dir: str
    version: tuple[int, int]


@cache
def toolchain() -> Toolchain:
    try:
        nvrtc = importlib.import_module("cuda.bindings.nvrtc")
        core = importlib.import_module("cuda.core")
        pathfinder = importlib.import_module("cuda.pathfinder")
        status, major, minor = nvrtc.nvrtcVersion()
    except Exception as e:  # ImportError, or the loader's error when libnvrtc is absent
        raise NVRTCUnavailableError(f"NVRTC is not available ({e}); install it with: {PIP_HINT}") from e
    if int(status) != 0:
        raise NVRTCUnavailableError(f"NVRTC failed to report its version ({status}); reinstall with: {PIP_HINT}")
    include = pathfinder.find_nvidia_header_directory("cudart")
    if include is None:
        raise NVRTCUnavailableError(f"CUDA runtime headers (cuda_fp16.h) not found; install them with: {PIP_HINT}")
    return Toolchain(core.Program, core.ProgramOptions, include, (major, minor))


def supported_archs() -> list[str]:
    from cuda.bindings import nvrtc

    _, count = nvrtc.nvrtcGetNumSupportedArchs()
    _, archs = nvrtc.nvrtcGetSupportedArchs()
    return [f"sm_{a}" for a in archs[:count]]


def _options(arch: str) -> Any:
    tc = toolchain()
    return tc.program_options(
        name=MAIN_FILE,
        arch=arch,
        std="c++17",
        include_path=[tc.include_dir, str(source_dir())],
        ptxas_options=["-v"],
        # Skips texture/surface and device-runtime declarations the kernels never use.
        minimal=True,
        # NVRTC 13.0 (the H100 image's) takes a generic lambda in a kernel for a host function and refuses it
        # (13.5 infers __device__); every function of a JIT unit is device code, so say it once here.
        device_as_default_execution_space=True,
    )


@dataclass(frozen=True)
class KernelInfo:
    """One kernel's resource use as ptxas reported it."""

    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    static_smem: int


@dataclass
class CompiledUnit:
    unit: Unit
    arch: str
    cubin: bytes
    # Name expression -> lowered (mangled) name, as bytes: cuLibraryGetKernel takes a C string,
    # and cuda.core passes these values to it unconverted.
    symbol_mapping: dict[str, bytes]
    log: str
    compile_s: float
    cached: bool
    infos: list[KernelInfo] = field(default_factory=list)


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")


def parse_ptxas(log: str, symbol_mapping: dict[str, bytes]) -> list[KernelInfo]:
    """Registers, spills and static shared memory per kernel from a `ptxas -v` log."""
    by_symbol = {mangled.decode(): name for name, mangled in symbol_mapping.items()}
    chunks = _ENTRY.split(log)
    infos = []
    for mangled, body in zip(chunks[1::2], chunks[2::2]):
        spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", body)
        regs = re.search(r"Used (\d+) registers", body)
        smem = re.search(r"(\d+) bytes smem", body)
        assert spills and regs, f"unexpected ptxas output for {mangled}:\n{body}"
        infos.append(KernelInfo(by_symbol.get(mangled, mangled), int(regs.group(1)), int(spills.group(1)),
                                int(spills.group(2)), int(smem.group(1)) if smem else 0))
    return infos


def compile_unit(unit: Unit, arch: str, *, use_cache: bool = True) -> CompiledUnit:
    """The cubin of `unit` for `arch` (e.g. "sm_90"), from the cache when a valid entry exists."""
    tc = toolchain()
    options = _options(arch)
    key = make_key("cubin", device_source_hash(), unit.kernels, options.as_bytes("nvrtc"), tc.version, arch)
    hit = _CACHE.get(key) if use_cache else None
    if hit is None:
        if not use_cache:
            return _compile(unit, arch, tc, options, key)
        with _CACHE.building(key):
            hit = _CACHE.get(key)  # another process may have compiled it while this one waited
            if hit is None:
                return _compile(unit, arch, tc, options, key)
    path, meta = hit
    mapping = {name: mangled.encode() for name, mangled in meta["symbol_mapping"].items()}
    return CompiledUnit(unit, arch, path.read_bytes(), mapping, meta["log"], meta["compile_s"], True,
                        parse_ptxas(meta["log"], mapping))


def _compile(unit: Unit, arch: str, tc: Toolchain, options: Any, key: str) -> CompiledUnit:
    """NVRTC's cubin of `unit`, stored under `key`."""
    log = io.StringIO()
    start = time.perf_counter()
    try:
        program = tc.program(main_source(), "c++", options=options)
        obj = program.compile("cubin", name_expressions=list(unit.kernels), logs=log)
    except Exception as e:
        if type(e).__name__ != "NVRTCError":
            raise
        raise KernelCompileError(f"NVRTC failed to compile {unit.label} for {arch}:\n{e}\n{log.getvalue()}") from e
    elapsed = time.perf_counter() - start
    mapping = {name: _lowered(mangled) for name, mangled in obj.symbol_mapping.items()}
    cubin = bytes(obj.code)
    if not cubin:
        raise KernelCompileError(f"NVRTC produced an empty cubin for {unit.label} ({arch}); use an sm_XX arch")
    # JSON holds text; the lowered names are ASCII by the Itanium ABI.
    stored = {name: mangled.decode() for name, mangled in mapping.items()}
    meta = {"symbol_mapping": stored, "log": log.getvalue(), "compile_s": elapsed, "unit": unit.label}
    _CACHE.put_bytes(key, cubin, meta)
    text = log.getvalue()
    return CompiledUnit(unit, arch, cubin, mapping, text, elapsed, False, parse_ptxas(text, mapping))


def _lowered(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def compile_units(
    units: Iterable[Unit], arch: str, *, jobs: int | None = None, use_cache: bool = True
) -> list[CompiledUnit]:
    """Compiles units in parallel threads (NVRTC releases the GIL), keeping the input order."""
    units = list(units)
    toolchain()
    jobs = max(1, jobs or os.cpu_count() or 1)
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda u: compile_unit(u, arch, use_cache=use_cache), units))
