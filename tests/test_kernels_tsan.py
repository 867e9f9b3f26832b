"""ThreadSanitizer over the emulated kernels: the real sources are race-free, and the same check
reports the race when one __syncthreads is removed (so it can fail)."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from paged.kernels.toolchain import emulator, host_compiler

FLAGS = ("-std=c++20", "-O1", "-g", "-fsanitize=thread", "-pthread", "-fno-strict-aliasing", "-Wno-unknown-pragmas")
TSAN_EXIT = 66
VARIANTS = {"clean": (), "dropped_barrier": ("PAGED_TEST_DROP_BARRIER",)}


@pytest.fixture(scope="module")
def drivers() -> dict[str, Path]:
    """Both variants, built concurrently (and cached like the emulator libraries)."""
    try:
        host_compiler.find_compiler()
    except host_compiler.CompilerNotFoundError as e:
        pytest.skip(f"emu backend unavailable: {e}")

    def build(defines: tuple[str, ...]) -> Path:
        source = "".join(f"#define {d}\n" for d in defines) + '#include "emu/tsan_driver.cpp"\n'
        try:
            return emulator.compile_executable(source, FLAGS)
        except host_compiler.HostBuildError as e:
            if "sanitize" in str(e):
                pytest.skip(f"the compiler cannot build with -fsanitize=thread: {str(e)[-500:]}")
            raise

    with ThreadPoolExecutor(len(VARIANTS)) as pool:
        return dict(zip(VARIANTS, pool.map(build, VARIANTS.values())))


def _run(binary: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary)], capture_output=True, text=True, timeout=300,
                          env={"TSAN_OPTIONS": f"exitcode={TSAN_EXIT} halt_on_error=0"})


def test_emulated_kernels_are_race_free(drivers: dict[str, Path]) -> None:
    result = _run(drivers["clean"])
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "all launches ran" in result.stdout


def test_a_missing_barrier_is_reported_as_a_race(drivers: dict[str, Path]) -> None:
    result = _run(drivers["dropped_barrier"])
    assert result.returncode == TSAN_EXIT
    assert "WARNING: ThreadSanitizer: data race" in result.stderr
    assert "attention.cuh" in result.stderr
