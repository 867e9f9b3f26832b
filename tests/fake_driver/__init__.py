"""A recording fake of the NVIDIA driver (`fake_libcuda.c`), built with the system C compiler, and
a runner for `scenario.py` in a subprocess that loads it in place of libcuda.so.1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SOURCE = Path(__file__).with_name("fake_libcuda.c")
REPO = Path(__file__).resolve().parents[2]


class NoCompilerError(RuntimeError):
    """No C compiler to build the fake driver with."""


def build(directory: Path) -> Path:
    """Compiles the fake into `directory/libcuda.so.1` and returns the directory."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NoCompilerError("no C compiler ($CC, cc or gcc) on PATH to build the fake libcuda.so.1 with")
    cmd = [compiler, "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
           "-Wl,-soname,libcuda.so.1", "-o", str(directory / "libcuda.so.1"), str(SOURCE), "-ldl", "-lpthread"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr}")
    return directory


def nvrtc_missing() -> str | None:
    """Why NVRTC (which a `CudaRunner` checks its driver against) cannot be used here, else `None`."""
    from paged.kernels.toolchain import nvrtc

    try:
        nvrtc.toolchain()
    except nvrtc.NVRTCUnavailableError as e:
        return str(e)
    return None


def build_or_skip(directory: Path) -> Path:
    """`build`, skipping the calling test where NVRTC or a C compiler is missing."""
    missing = nvrtc_missing()
    if missing:
        pytest.skip(missing)
    try:
        return build(directory)
    except NoCompilerError as e:
        pytest.skip(str(e))


@dataclass
class Run:
    results: dict[str, Any]  # case id -> what scenario.py reported
    calls: dict[str, list[dict[str, Any]]]  # case id -> the driver calls made while it ran
    stderr: str


def run_scenario(scenario: str, workdir: Path, driver_dir: Path | None, **settings: str) -> Run:
    """Runs `scenario.py` in a fresh interpreter whose libcuda.so.1 is the fake in `driver_dir`
    (none: the machine's own, if any), with `FAKE_CUDA_*` settings."""
    log, out = workdir / f"{scenario}.calls.jsonl", workdir / f"{scenario}.results.json"
    env = {**os.environ, "FAKE_CUDA_LOG": str(log), **{f"FAKE_CUDA_{k.upper()}": v for k, v in settings.items()}}
    if driver_dir is not None:
        # The loader reads LD_LIBRARY_PATH when the process starts, hence the subprocess.
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(driver_dir), env.get("LD_LIBRARY_PATH")]))
    proc = subprocess.run([sys.executable, "-m", "tests.fake_driver.scenario", scenario, str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"scenario {scenario} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    calls: dict[str, list[dict[str, Any]]] = {"": []}
    case = ""
    for line in log.read_text().splitlines() if log.exists() else []:
        record = json.loads(line)
        if "case" in record:
            case = record["case"]
            calls[case] = []
        else:
            calls[case].append(record)
    return Run(json.loads(out.read_text()), calls, proc.stderr)
