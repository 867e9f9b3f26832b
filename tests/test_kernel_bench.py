"""experiments/gpu/kernel_bench.py on this CPU (`--device cpu`, the native cpu backend): `--v3-splits`
adds a column per forced v3 split count beside the planner's `v3`, and a count the scratch cannot hold
is one line before anything runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from paged import kernels

pytestmark = [pytest.mark.subprocess, pytest.mark.compiles]

REPO = Path(__file__).resolve().parents[1]
BENCH = [sys.executable, "experiments/gpu/kernel_bench.py", "--device", "cpu", "--dtype", "bfloat16", "--peers",
         "--iters", "1", "--repeats", "3"]


def test_forced_v3_split_counts_get_a_column_each() -> None:
    why = kernels.get_backend("cpu").unavailable_reason()
    if why is not None:
        pytest.skip(f"the native cpu backend is unavailable: {why}")
    proc = subprocess.run([*BENCH, "--shapes", "2x512", "--v3-splits", "1", "4"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    header = next(line for line in proc.stdout.splitlines() if line.lstrip().startswith("batch"))
    assert "v3 µs" in header and "v3/1 µs" in header and "v3/4 µs" in header
    row = next(line for line in proc.stdout.splitlines() if line.split()[:2] == ["2", "512"])
    # every cell timed: v1, v2, v3, v3/1, v3/4 and the torch reference each show µs and a % of the probe
    assert row.count("%") >= 2 * 6, row


def test_a_split_count_past_the_scratch_is_one_line() -> None:
    proc = subprocess.run([*BENCH, "--shapes", "2x512", "--v3-splits", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("--v3-splits 0 is not a split count; allowed: 1..256")


@pytest.mark.parametrize("backend", ["cpu", "emu"])
def test_a_workspace_planned_for_a_forced_split_count_has_it(backend: str) -> None:
    """What the columns time: `decode_workspace(num_splits=)` plans v3 with that many splits, other
    than the planner's own choice."""
    import torch

    impl = kernels.get_backend(backend)

    def splits(forced: int | None) -> int:
        workspace = impl.decode_workspace(2, 8, 2, 64, 16, "v3", 512, 4096, None, torch.device("cpu"),
                                          num_splits=forced)
        return getattr(workspace, "plan", workspace).num_splits

    planned = splits(None)  # of the row's 4096 / 32 = 128 tiles: a power of two, as those below
    for forced in (2 * planned, planned // 2 if planned > 1 else 4):
        assert splits(forced) == forced
