"""ThreadSanitizer over the emulated kernels: the real sources are race-free, and the same check
reports the race when one __syncthreads is removed (so it can fail)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.sanitizer_builds import build_variants

pytestmark = pytest.mark.compiles

# -g1: line tables only, all a report needs to name its source file, at less compile time than -g
FLAGS = ("-std=c++20", "-O1", "-g1", "-fsanitize=thread", "-pthread", "-fno-strict-aliasing", "-Wno-unknown-pragmas")
TSAN_EXIT = 66
VARIANTS = {"clean": (), "dropped_barrier": ("PAGED_TEST_DROP_BARRIER",)}


@pytest.fixture(scope="module")
def drivers() -> dict[str, Path]:
    return build_variants(FLAGS, VARIANTS)


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
