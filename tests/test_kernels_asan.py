"""AddressSanitizer + UndefinedBehaviorSanitizer over the emulated kernels, the CPU counterpart of
compute-sanitizer memcheck: every access the real sources make, over every dtype, block size and
head size, stays inside its buffer without undefined behaviour; and the same checks report a block
table one block short of the longest sequence (ASan), a misaligned query (UBSan) and a v3 split past
its scratch once the kernel's guard is gone (ASan), so they can fail."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from paged.kernels.toolchain.source import source_dir
from tests.sanitizer_builds import build_variants

pytestmark = pytest.mark.compiles

FLAGS = (
    "-std=c++20",
    "-O1",
    # line tables only: what a report's frames need (file:line, checked below), at ~2/3 of -g's
    # compile time (the clean build over every instantiation: 87 -> 61 s of CPU on a 2-core EPYC)
    "-g1",
    "-fsanitize=address,undefined",
    # UBSan only warns and carries on by default; a report must fail the run.
    "-fno-sanitize-recover=undefined",
    "-fno-omit-frame-pointer",
    "-pthread",
    "-fno-strict-aliasing",
    "-Wno-unknown-pragmas",
)
# Distinct from each other and from the driver's own failure statuses (1..3), so a test knows
# which tool stopped the run.
ASAN_EXIT = 67
UBSAN_EXIT = 68
ENV = {
    # Leak checking adds nothing here (the kernels allocate nothing, the driver's buffers are
    # vectors) but needs ptrace for its stop-the-world, which sandboxed CI containers may refuse.
    "ASAN_OPTIONS": f"exitcode={ASAN_EXIT}:halt_on_error=1:detect_leaks=0",
    "UBSAN_OPTIONS": f"exitcode={UBSAN_EXIT}:halt_on_error=1:print_stacktrace=1",
    # Where a runtime symbolizes through an external tool (llvm-symbolizer), it must find it, or
    # the reports carry no file names.
    "PATH": os.environ.get("PATH", ""),
}
VARIANTS = {
    "clean": (),
    "oob_block_table": ("PAGED_TEST_OOB_BLOCK_TABLE",),
    "misaligned_query": ("PAGED_TEST_MISALIGNED_QUERY",),
    "no_split_guard": ("PAGED_TEST_NO_SPLIT_GUARD",),
}


@pytest.fixture(scope="module")
def drivers() -> dict[str, Path]:
    return build_variants(FLAGS, VARIANTS)


def _run(binary: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(binary)], capture_output=True, text=True, timeout=300, env=ENV)


def _lines_containing(path: Path, needle: str) -> set[int]:
    """1-based numbers of the lines of `path` that contain `needle`, to pin a report's frame to a statement."""
    lines = path.read_text().splitlines()
    found = {number for number, line in enumerate(lines, start=1) if needle in line}
    assert found, f"{needle!r} no longer occurs in {path}"
    return found


def test_asan_ubsan_emulated_kernels_are_clean(drivers: dict[str, Path]) -> None:
    result = _run(drivers["clean"])
    assert "AddressSanitizer" not in result.stderr, result.stderr[-4000:]
    assert "runtime error" not in result.stderr, result.stderr[-4000:]
    assert result.returncode == 0, result.stderr[-4000:]
    assert "all launches ran" in result.stdout


def test_asan_reports_out_of_bounds_block_table_read(drivers: dict[str, Path]) -> None:
    result = _run(drivers["oob_block_table"])
    assert result.returncode == ASAN_EXIT, result.stderr[-4000:]
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in result.stderr
    assert "READ of size 4" in result.stderr  # one int entry of the table
    # The faulting statement is the kernel's table lookup and the overflowed buffer is the
    # driver's table, not some other access that happened to overflow.
    summary = re.search(r"SUMMARY: AddressSanitizer: heap-buffer-overflow \S*attention\.cuh:(\d+)", result.stderr)
    assert summary is not None, result.stderr[-4000:]
    assert int(summary.group(1)) in _lines_containing(source_dir() / "attention.cuh", "block_table[block_idx]")
    allocated = result.stderr.split("allocated by thread", 1)[-1]
    table_lines = _lines_containing(source_dir() / "emu" / "sanitizer_driver.cpp", "std::vector<int> tables(")
    assert any(f"sanitizer_driver.cpp:{line}" in allocated for line in table_lines), allocated[:4000]


def test_asan_ubsan_reports_misaligned_query_load(drivers: dict[str, Path]) -> None:
    result = _run(drivers["misaligned_query"])
    assert result.returncode == UBSAN_EXIT, result.stderr[-4000:]
    assert re.search(r"vec\.cuh:\d+(:\d+)?: runtime error: .*misaligned address", result.stderr), result.stderr[-4000:]
    assert "attention.cuh" in result.stderr


def test_asan_reports_a_v3_split_past_the_scratch_once_the_guard_is_gone(drivers: dict[str, Path]) -> None:
    """The clean run launches v3 with six splits over a scratch of four and is clean because the
    kernel checks the split index; without that check the same launch writes past the scratch."""
    result = _run(drivers["no_split_guard"])
    assert result.returncode == ASAN_EXIT, result.stderr[-4000:]
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in result.stderr
    assert re.search(r"WRITE of size 4 .*\n(.*\n)*?.*decode_v3\.cuh", result.stderr), result.stderr[-4000:]
