"""experiments/host_overhead.py, as a user runs it: per batch size, the host µs of a kernel launch on
the recording driver (with the op call, cuda.core's own launch and a layer's attention through
`torch.ops.paged` beside it) and the host ms of an engine step whose model returns at once; one
table and, with --json, the same numbers in a file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import fake_driver

pytestmark = [pytest.mark.subprocess, pytest.mark.compiles]

REPO = Path(__file__).resolve().parents[1]


def test_the_benchmark_writes_launch_and_step_overheads_keyed_by_batch(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, "experiments/host_overhead.py", "--batches", "1", "4", "--steps", "3", "--repeats", "1",
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert set(results["step_overhead_ms"]) == {"1", "4"}
    assert all(v > 0 for v in results["step_overhead_ms"].values())
    assert "step_overhead_ms" in proc.stdout and "launch_us" in proc.stdout and "torch_op_us" in proc.stdout
    missing = fake_driver.nvrtc_missing()
    if missing:
        assert results["launch_us"] is None and results["launch_unavailable"] == missing
        return
    assert results["launch_unavailable"] is None, results["launch_unavailable"]
    assert results["torch_ops_registration_ms"] > 0
    for key in ("launch_us", "layer_us", "op_us", "cuda_core_launch_us", "torch_op_us", "attention_us",
                "layer_ops_us", "prefill_us"):
        assert set(results[key]) == {"1", "4"} and all(v > 0 for v in results[key].values()), key
    # a layer's call plans before it launches, and the op also checks every input: neither costs less than
    # the launch
    assert all(results["op_us"][b] > results["launch_us"][b] < results["layer_us"][b] for b in ("1", "4"))


def test_the_real_driver_without_a_gpu_is_one_line() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device (make gpu-report runs --real-driver there)")
    proc = subprocess.run([sys.executable, "experiments/host_overhead.py", "--real-driver"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("host_overhead.py: error: --real-driver needs a CUDA device")
