"""experiments/gpu/kernel_bench.py on this CPU (`--device cpu`, the native cpu backend): `--v3-splits`
adds a column per forced v3 split count beside the planner's `v3`, `--v3-stages` one per forced
pipeline depth (a note here: the cpu backend has none), and a count the scratch cannot hold or a
depth the kernel is not built for is one line before anything runs; the targets' verdicts
(kernel_targets.py) on results made up to sit either side of each bar."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_a_forced_depth_gets_a_column_and_the_cpu_backend_says_it_has_none() -> None:
    why = kernels.get_backend("cpu").unavailable_reason()
    if why is not None:
        pytest.skip(f"the native cpu backend is unavailable: {why}")
    proc = subprocess.run([*BENCH, "--shapes", "2x256", "--v3-stages", "4"], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    header = next(line for line in proc.stdout.splitlines() if line.lstrip().startswith("batch"))
    assert "v3:s4 µs" in header
    row = next(line for line in proc.stdout.splitlines() if line.split()[:2] == ["2", "256"])
    assert "-[1]" in row
    note = "[1] v3:s4: ValueError: num_stages=4 forces a CUDA v3 pipeline, which backend='cpu' does not run"
    assert note in proc.stdout


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--v3-splits", "0", "--v3-splits 0 is not a split count; allowed: 1..256"),
    ("--v3-stages", "1", "--v3-stages 1 is not a v3 pipeline depth; allowed: 2..8"),
    ("--v3-stages", "9", "--v3-stages 9 is not a v3 pipeline depth; allowed: 2..8"),
])
def test_a_split_count_or_depth_the_kernel_cannot_take_is_one_line(flag: str, value: str, message: str) -> None:
    proc = subprocess.run([*BENCH, "--shapes", "2x512", flag, value], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(message)


@pytest.mark.parametrize("backend", ["cpu", "emu"])
def test_a_workspace_planned_for_a_forced_split_count_has_it(backend: str) -> None:
    """What the columns time: `decode_workspace(num_splits=)` plans v3 with that many splits, other
    than the planner's own choice."""
    impl = kernels.get_backend(backend)

    def splits(forced: int | None) -> int:
        workspace = impl.decode_workspace(2, 8, 2, 64, 16, "v3", 512, 4096, None, torch.device("cpu"),
                                          num_splits=forced)
        return getattr(workspace, "plan", workspace).num_splits

    planned = splits(None)  # of the row's 4096 / 32 = 128 tiles: a power of two, as those below
    for forced in (2 * planned, planned // 2 if planned > 1 else 4):
        assert splits(forced) == forced


def test_the_targets_are_issue_44s_each_met_or_not_by_its_own_bar() -> None:
    """Made-up results on either side of each bar (a 1,000 GB/s probe): 64x4096 at 91% and faster
    than cuDNN, 256x1024 at 89% and slower, 1x16384 at 61%, 1x4096 at 39%; fp8 1.6x; rows missing
    their peers say what would measure them."""
    sys.path.insert(0, str(REPO / "experiments" / "gpu"))
    from kernel_inputs import kv_bytes
    from kernel_targets import check_targets
    from kernel_timing import Timing

    probe = 1e12

    def at(batch: int, context: int, percent: float) -> Timing:
        return Timing(kv_bytes(batch, context, torch.float16) / (percent / 100 * probe) * 1e6, 1.0)

    fast, slow = at(64, 4096, 91), at(256, 1024, 89)
    results = {
        (64, 4096, "fp16", "="): {"v3": fast, "sdpa-cudnn": Timing(fast.us * 1.01, 1.0)},
        (256, 1024, "fp16", "="): {"v3": slow, "sdpa-cudnn": Timing(slow.us * 0.99, 1.0)},
        (1, 16384, "fp16", "="): {"v3": at(1, 16384, 61)},
        (1, 4096, "fp16", "="): {"v3": at(1, 4096, 39)},
        (64, 4096, "fp16", "e4m3"): {"v3": Timing(fast.us / 1.6, 1.0)},
    }
    lines = check_targets(results, probe)
    assert "  v3 64x4096 fp16 >= 90% of the read probe: 91%, met" in lines
    assert "  v3 256x1024 fp16 >= 90% of the read probe: 89%, NOT met" in lines
    assert "  v3 1x16384 fp16 >= 60% of the read probe: 61%, met" in lines
    assert "  v3 1x4096 fp16 >= 40% of the read probe: 39%, NOT met" in lines
    assert "  v3 64x4096 fp16 >= sdpa-cudnn's speed: sdpa-cudnn / v3 = 1.01, met" in lines
    assert "  v3 256x1024 fp16 >= sdpa-cudnn's speed: sdpa-cudnn / v3 = 0.99, NOT met" in lines
    assert "  v3 64x4096 fp8 e4m3 cache >= 1.6x faster than fp16: 1.60x, met" in lines
    assert "  v3 1x16384 bf16 within 5% of fp16: not measured (--dtype float16 bfloat16)" in lines
