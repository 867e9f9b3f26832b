"""Builds of kernels_cu/emu/sanitizer_driver.cpp under a sanitizer, one per planted-defect variant,
shared by the TSan and ASan+UBSan tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from paged.kernels.toolchain import emulator, host_compiler


def _unsupported(flags: Sequence[str]) -> str | None:
    """Why the compiler cannot build a trivial program with `flags` (no sanitizer runtime), else
    `None`: then a failed driver build is a real error, not a reason to skip."""
    try:
        emulator.compile_executable("int main() { return 0; }\n", flags)
    except host_compiler.HostBuildError as e:
        return str(e)[-500:]
    return None


def build_variants(flags: Sequence[str], variants: Mapping[str, tuple[str, ...]]) -> dict[str, Path]:
    """Each variant's driver (its defines set), built concurrently and cached like the emulator
    libraries; skips the test when the compiler or its sanitizer runtime is missing."""
    try:
        host_compiler.find_compiler()
    except host_compiler.CompilerNotFoundError as e:
        pytest.skip(f"emu backend unavailable: {e}")

    def build(defines: tuple[str, ...]) -> Path:
        source = "".join(f"#define {d}\n" for d in defines) + '#include "emu/sanitizer_driver.cpp"\n'
        return emulator.compile_executable(source, flags)

    try:
        with ThreadPoolExecutor(len(variants)) as pool:
            return dict(zip(variants, pool.map(build, variants.values())))
    except host_compiler.HostBuildError:
        reason = _unsupported(flags)
        if reason is not None:
            pytest.skip(f"the compiler cannot build with {' '.join(f for f in flags if 'sanitize=' in f)}: {reason}")
        raise
