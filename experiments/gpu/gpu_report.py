"""The GPU agenda as one command: the CUDA tests, the kernel benchmarks and the default job (CUDA graphs
off and on, CUDA and the CPU, our kernels and torch's), written to one markdown report.

    python experiments/gpu/gpu_report.py [--out experiments/results/gpu/] [--skip-tests] [--skip-bench]
        [--skip-job] [--budget-min 20]
    make gpu-report ARGS="--skip-bench"

Writes `<out>/<date>-<gpu>.md`: the device, its driver and the versions, then one section per step:

1. CUDA tests: `pytest -q -rfEs tests/*cuda*.py` (the kernels, the driver, CUDA graphs), with counts,
   skip reasons and, on failure, the failing tests and the output's tail.
2. Kernel benchmarks, each output verbatim: decode attention, `experiments/gpu/kernel_bench.py --repeats 5`
   on the shapes of the H100 tables in docs/gpu.md (their setting, so rows compare; the v3 targets'
   shapes first), our v1 / v2 / v3 with the SDPA and FlashInfer peers (FlashInfer where `.flashinfer/`
   was carried, docs/gpu.md); then prefill attention,
   `experiments/gpu/prefill_bench.py --device cuda --repeats 5` (our paged varlen kernel against torch
   SDPA-flash on contiguous inputs and the torch reference; its lowest cuda / sdpa-flash throughput ratio
   against issue 44's >= 70% target and 50% floor, the cached-prefix rows against 100%). Each has its
   share of the step (BENCHES), so a hang in the first leaves the second its time, and a failure of one
   is reported beside the other's output. Then the host's cost,
   `experiments/host_overhead.py --real-driver`: µs per launch on this GPU's driver, ms per engine step
   without the model on its CPU.
3. The default job: on CUDA in fp32 with `executor.cuda_graphs=false`, on this machine's CPU in fp32 (the
   outputs' reference; these fp32 runs take 16 requests), on CUDA as configured by default (bfloat16,
   graphs on), the same with `kernel.backend=torch` (the torch kernels and layer ops; that backend cannot
   be captured, so its decode steps run eagerly), and on CUDA in fp32 with graphs on; then under load (512
   requests, 256 at once, `kernel=auto` and `kernel=v3`), and `model=llama-3-8b-random` on 512 requests
   of the ShareGPT fit beside `executor=sim model=llama-3-8b` on this GPU's hardware preset: throughput,
   TPOT / ITL, TTFT, times, the CUDA-graph step counters; the TTFT mean of the torch kernels over ours on
   the same prompts (the target: >= 3x); the real Llama-3-8B-shaped run against the simulator's (the
   target: within 15%); and how many requests produced the same output token ids with graphs off and on,
   on CUDA and the CPU, and with our kernels and torch's.

Each step is a subprocess from the repository root, so a crash or a hang in one is reported and the next
still runs. The steps share `--budget-min`: each may use what is left less the shares (SHARES) of the
steps after it, is killed at that timeout, and is skipped with a note when under MIN_STEP_S is left.
Without a CUDA device it refuses at once (exit 2). The records are in
gpu_report_records.py, the markdown in gpu_report_render.py.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from paged.kernels.backends.cuda import driver_version
from paged.kernels.toolchain import nvrtc

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report_records import (  # noqa: E402  (sibling script, not a package)
    BenchResult,
    BenchRun,
    CommandRun,
    Environment,
    JobResult,
    JobRun,
    OutputComparison,
    Section,
    SimComparison,
    Skipped,
    TestsResult,
    TtftRatio,
)
from gpu_report_render import COUNT_ORDER, render_report, report_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "experiments" / "results" / "gpu"
# Shares of the budget each step is guaranteed; one step may also use what an earlier one left unused.
SHARES = {"tests": 0.30, "bench": 0.35, "job": 0.35}
MIN_STEP_S = 30.0  # less than this cannot even load the model, so the step is skipped instead
# kernel_bench.py's rows: the shapes of the H100 tables in docs/gpu.md, the v3 targets' three first so that a
# bench cut short by its share still has them
DECODE_SHAPES = ("64x4096", "256x1024", "1x16384", "1x512", "1x4096", "16x1024", "16x16384", "256x16384")
# the peers that compile nothing per shape: FlexAttention's torch.compile per row would not fit the share
# (docs/gpu.md gives the command that times it on the v3 targets' shapes)
DECODE_PEERS = ("sdpa-flash", "sdpa-cudnn", "flashinfer")
# (label, script and arguments, share of the step it is guaranteed). kernel_bench.py at the repeats of the
# H100 sessions in docs/gpu.md, so their tables compare with this one (its 16 rows take a few minutes);
# prefill_bench.py's 2 shapes x 5 workloads take well under a minute once NVRTC has compiled.
BENCHES = (
    ("decode attention", ["experiments/gpu/kernel_bench.py", "--repeats", "5", "--shapes", *DECODE_SHAPES,
                          "--peers", *DECODE_PEERS], 0.6),
    ("prefill attention", ["experiments/gpu/prefill_bench.py", "--device", "cuda", "--repeats", "5"], 0.25),
    # host µs per launch on this GPU's driver, host ms per engine step without the model on its CPU (issue 43)
    ("host overhead", ["experiments/host_overhead.py", "--real-driver"], 0.15),
)
# model.device=cuda, though `auto` picks CUDA here: a run that fell back to the CPU must fail, not report.
JOB_OVERRIDES = ["logger=none", "progress=false"]
# the fp32 runs whose outputs are compared: 16 requests, as the CPU reference of 48 took over a minute there
FP32 = ["model.dtype=float32", "workload.num_requests=16"]
# the engine under load: 512 requests, 256 running at once
LOAD = ["model.device=cuda", "workload.num_requests=512", "scheduler.max_num_seqs=256"]
# a model of the size KV-cache research studies, on the GPU and in the simulator: 512 requests of the
# ShareGPT fit, all at once
LLAMA = ["workload=sharegpt", "workload.num_requests=512", "workload.arrival_rate=0"]
# (label, overrides): the label names the run's folder and its column in the report. The simulated run
# also gets `hardware=` this GPU's preset (`sim_hardware`), and is left out where there is none.
JOB_RUNS = (
    ("cuda-fp32-graphs-off", ["model.device=cuda", *FP32, "executor.cuda_graphs=false"]),
    ("cpu-fp32", ["model.device=cpu", *FP32]),
    ("cuda-default", ["model.device=cuda"]),
    ("cuda-torch-kernels", ["model.device=cuda", "kernel.backend=torch"]),
    ("cuda-fp32-graphs-on", ["model.device=cuda", *FP32, "executor.cuda_graphs=true"]),
    # async scheduling is on by default on CUDA: the same run with it off must sample the same tokens
    ("cuda-fp32-async-off",
     ["model.device=cuda", *FP32, "executor.cuda_graphs=true", "scheduler.async_scheduling=false"]),
    ("cuda-load-auto", LOAD),
    ("cuda-load-v3", [*LOAD, "kernel=v3"]),
    ("cuda-llama-3-8b-random", ["model=llama-3-8b-random", "model.device=cuda", *LLAMA]),
    ("sim-llama-3-8b", ["executor=sim", "model=llama-3-8b", *LLAMA]),
)
SIMULATED = "sim-llama-3-8b"
# the table's ratio column: fp32 graphs on over off (the earlier H100 runs were fp32, eager)
RATIO = ("cuda-fp32-graphs-on", "cuda-fp32-graphs-off")
# the pairs of runs whose outputs are compared token by token: fp32 ones must be identical; the bf16 pair
# (our kernels, torch's) shows how far rounding takes them apart
COMPARED = (("cuda-fp32-graphs-off", "cuda-fp32-graphs-on"), ("cpu-fp32", "cuda-fp32-graphs-on"),
            ("cuda-fp32-async-off", "cuda-fp32-graphs-on"), ("cuda-default", "cuda-torch-kernels"))
# the prefill target: TTFT at least 3x lower with our kernels than with torch's, on the same prompts
TTFT = TtftRatio(slower="cuda-torch-kernels", faster="cuda-default", target=3.0)
# issue 43's target: the real engine on the Llama-3-8B shape within 15% of the simulator's output tok/s
SIM = SimComparison(real="cuda-llama-3-8b-random", simulated=SIMULATED, target=0.15)
# (what the device's name contains, the simulator's hardware preset), first match wins
HARDWARE = (("H200", "h200"), ("H100", "h100-sxm"), ("A100", "a100-40g"), ("L4", "l4"))


def sim_hardware(gpu: str, memory_gib: float) -> str | None:
    """The `conf/hardware/` preset of the GPU named `gpu`, or None where the simulator has none."""
    preset = next((p for key, p in HARDWARE if key in gpu.upper()), None)
    return "a100-80g" if preset == "a100-40g" and memory_gib > 60 else preset


# -- running the steps -----------------------------------------------------------------------------


@dataclass
class Budget:
    total_s: float
    start: float = field(default_factory=time.monotonic)

    def used_s(self) -> float:
        return time.monotonic() - self.start

    def allowance(self, later: Sequence[str]) -> float:
        """Seconds the next step may take: what is left, less the shares of the `later` steps."""
        return self.total_s - self.used_s() - self.total_s * sum(SHARES[step] for step in later)


def run_command(command: list[str], timeout_s: float) -> CommandRun:
    """Run `command` from the repository root; at `timeout_s` kill its process group, so that any child
    it started goes too, and keep what it printed until then."""
    env = {**os.environ, "WANDB_MODE": "disabled"}
    start = time.monotonic()
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            returncode: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it may have exited since the timeout fired
                os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
            returncode = None
    return CommandRun(command, returncode, stdout, stderr, time.monotonic() - start, timeout_s)


def pytest_counts(output: str) -> dict[str, int]:
    """The counts of pytest's summary line ("1 failed, 60 passed, 2 skipped, 3 warnings in 37.61s"),
    plurals folded ("errors" -> "error"); {} when there is none (killed, or no tests ran)."""
    for line in reversed(output.splitlines()):
        head, sep, _ = line.strip("= \t").rpartition(" in ")
        if not sep or not re.fullmatch(r"\d+ \w+(, \d+ \w+)*", head):
            continue
        counts = {word.removesuffix("s") if word in ("errors", "warnings") else word: int(n)
                  for n, word in re.findall(r"(\d+) (\w+)", head)}
        if set(counts) <= set(COUNT_ORDER):  # not a test's own output that happens to look alike
            return counts
    return {}


def summary_lines(output: str, kinds: Sequence[str]) -> list[str]:
    """The lines of pytest's short test summary that start with one of `kinds` (FAILED, ERROR, SKIPPED);
    only that section, since captured logs elsewhere start lines with ERROR too."""
    _, _, summary = output.rpartition("short test summary info")
    return [line for line in summary.splitlines() if line.split(" ", 1)[0] in kinds]


def cuda_test_files() -> list[str]:
    # every CUDA-named test file: test_kernels_cuda.py, test_cuda_driver.py, test_cuda_graphs.py once it lands
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*cuda*.py"))


def run_tests(timeout_s: float) -> TestsResult | Skipped:
    files = cuda_test_files()
    if not files:
        return Skipped("no tests/*cuda*.py")
    # -rfEs: skip reasons, and the FAILED / ERROR lines that a bare -rs would drop
    run = run_command([sys.executable, "-m", "pytest", "-q", "-rfEs", *files], timeout_s)
    return TestsResult(run, pytest_counts(run.stdout), summary_lines(run.stdout, ("FAILED", "ERROR")),
                       summary_lines(run.stdout, ("SKIPPED",)))


def run_bench(timeout_s: float) -> BenchResult:
    """Each of BENCHES in turn, whatever became of the one before: each may use what is left of
    `timeout_s` less the shares of the ones after it."""
    start = time.monotonic()
    runs = []
    for i, (label, script, _) in enumerate(BENCHES):
        later = sum(share for _, _, share in BENCHES[i + 1:])
        left = timeout_s - (time.monotonic() - start) - timeout_s * later
        runs.append(BenchRun(label, run_command([sys.executable, *script], max(left, 1.0))))
    return BenchResult(runs)


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def read_outputs(path: Path) -> dict[str, list[int]]:
    """requests.jsonl as request id -> output token ids (the best completion's)."""
    records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {str(r["request_id"]): r["output_token_ids"] for r in records}


def compare_outputs(first: dict[str, list[int]], second: dict[str, list[int]]) -> OutputComparison:
    """Token-by-token agreement of two runs' outputs; a request missing from one run counts as differing."""
    request_ids = list(dict.fromkeys([*first, *second]))  # the first run's order, then any only in the second
    identical = tokens = matching = 0
    first_difference = None
    for request_id in request_ids:
        a, b = first.get(request_id, []), second.get(request_id, [])
        agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        tokens += max(len(a), len(b))
        matching += agree
        if a == b and request_id in first and request_id in second:
            identical += 1
        elif first_difference is None:
            first_difference = f"request {request_id}, token {agree}"
    return OutputComparison(len(request_ids), identical, tokens, matching, first_difference)


def this_gpus_preset() -> str | None:
    return sim_hardware(torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).total_memory / 2**30)


def job_runs(hardware: str | None) -> list[tuple[str, list[str]]]:
    """JOB_RUNS, the simulated run on `hardware` (left out when None)."""
    return [(label, [*overrides, f"hardware={hardware}"] if label == SIMULATED else overrides)
            for label, overrides in JOB_RUNS if label != SIMULATED or hardware is not None]


def run_job(timeout_s: float, hardware: str | None = None) -> JobResult:
    """The default job once per `job_runs(hardware)` entry; each run may use its share of what is left."""
    start = time.monotonic()
    runs = []
    planned = job_runs(hardware)
    with tempfile.TemporaryDirectory(prefix="gpu-report-") as tmp:
        for i, (label, overrides) in enumerate(planned):
            run_dir = Path(tmp) / label
            command = [sys.executable, "run.py", *JOB_OVERRIDES, *overrides, f"hydra.run.dir={run_dir}"]
            left = timeout_s - (time.monotonic() - start)
            runs.append(JobRun(label, run_command(command, left / (len(planned) - i)), read_summary(run_dir)))
        succeeded = {r.label for r in runs if r.run.ok}
        outputs = []
        for first, second in COMPARED:
            paths = [Path(tmp) / label / "requests.jsonl" for label in (first, second)]
            if {first, second} <= succeeded and all(p.is_file() for p in paths):
                outputs.append((first, second, compare_outputs(*map(read_outputs, paths))))
    return JobResult(runs, outputs, TTFT, RATIO, SIM)


# -- the environment -------------------------------------------------------------------------------


def _command_output(command: list[str]) -> str | None:
    """What a quick command prints, stripped, or None if it is missing, fails or hangs."""
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def driver() -> str:
    """The NVIDIA driver's version from nvidia-smi, else the CUDA version its driver API reports."""
    versions = _command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if versions:
        return versions.splitlines()[0]  # one line per GPU, all from the same driver
    try:
        cuda = driver_version()
    except Exception as e:  # CudaDriverError, or cuda-python missing: the report says so and goes on
        return f"unknown (no nvidia-smi; driver API: {e})"
    return f"CUDA {cuda // 1000}.{cuda % 1000 // 10} (driver API; no nvidia-smi)"


def nvrtc_version() -> str:
    try:
        return ".".join(map(str, nvrtc.toolchain().version))
    except nvrtc.NVRTCUnavailableError as e:
        return f"unavailable ({e})"


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment() -> Environment:
    props = torch.cuda.get_device_properties(0)
    # tracked files only: untracked ones (outputs/, scratch) do not change what the commit runs
    changes = _command_output(["git", "status", "--porcelain", "--untracked-files=no"])
    return Environment(
        gpu=torch.cuda.get_device_name(0),
        memory_gib=props.total_memory / 2**30,
        capability=torch.cuda.get_device_capability(0),
        multiprocessors=props.multi_processor_count,
        driver=driver(),
        torch=torch.__version__,
        cuda=str(torch.version.cuda),
        nvrtc=nvrtc_version(),
        packages={name: package_version(name) for name in ("cuda-core", "cuda-bindings")},
        python=platform.python_version(),
        commit=_command_output(["git", "rev-parse", "--short", "HEAD"]) or "unknown",
        dirty=bool(changes),
        date=datetime.now().astimezone(),
    )


def missing_cuda() -> str:
    """Why torch sees no CUDA device, in one line."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA; a CUDA build of torch and an NVIDIA GPU are needed"
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: no NVIDIA device or driver "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


# -- the command -----------------------------------------------------------------------------------


def run_steps(args: argparse.Namespace, budget: Budget) -> dict[str, Section]:
    """Run the steps not skipped by a flag, in order, each within its allowance of the budget."""
    runners = {"tests": run_tests, "bench": run_bench, "job": lambda timeout_s: run_job(timeout_s, this_gpus_preset())}
    flags = {"tests": args.skip_tests, "bench": args.skip_bench, "job": args.skip_job}
    planned = [step for step in runners if not flags[step]]
    results: dict[str, Section] = {step: Skipped(f"--skip-{step}") for step in runners if flags[step]}
    for i, step in enumerate(planned):
        allowance = budget.allowance(planned[i + 1:])
        if allowance < MIN_STEP_S:
            results[step] = Skipped(f"over budget, {max(allowance, 0):.0f} s left for it after "
                                    f"{budget.used_s() / 60:.1f} min")
            continue
        print(f"gpu_report: {step} (up to {allowance:.0f} s)", flush=True)
        results[step] = runners[step](allowance)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of the report (default: %(default)s)")
    parser.add_argument("--skip-tests", action="store_true", help="no CUDA tests")
    parser.add_argument("--skip-bench", action="store_true", help="no kernel benchmarks")
    parser.add_argument("--skip-job", action="store_true", help="no default-job runs")
    parser.add_argument("--budget-min", type=float, default=20.0, help="minutes the whole run may take")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_report: no CUDA device: {missing_cuda()}", file=sys.stderr)
        return 2
    budget = Budget(args.budget_min * 60)
    env = environment()
    results = run_steps(args, budget)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / report_name(env)
    path.write_text(render_report(env, results["tests"], results["bench"], results["job"], args.budget_min))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
