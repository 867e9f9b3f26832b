"""The GPU agenda as one command: the CUDA tests, the kernel benchmark and the default job with CUDA graphs
off and on, written to one markdown report.

    python experiments/gpu_report.py [--out experiments/results/gpu/] [--skip-tests] [--skip-bench]
        [--skip-job] [--budget-min 20]
    make gpu-report ARGS="--skip-bench"

Writes `<out>/<date>-<gpu>.md`: the device, its driver and the versions, then one section per step:

1. CUDA tests: `pytest -q -rfEs tests/*cuda*.py` (the kernels, the driver, CUDA graphs), with counts,
   skip reasons and, on failure, the failing tests and the output's tail.
2. Kernel benchmark: `experiments/kernel_bench.py --repeats 5` (the setting of the H100 tables in
   docs/gpu.md, so rows compare), its output verbatim.
3. The default job: on CUDA in fp32 with `executor.cuda_graphs=false`, on this machine's CPU in fp32 (the
   outputs' reference), on CUDA as configured by default (bfloat16, graphs on), and on CUDA in fp32 with
   graphs on: throughput, TPOT / ITL, times, the CUDA-graph step counters, and how many requests produced
   the same output token ids with graphs off and on, and on CUDA and the CPU.

Each step is a subprocess from the repository root, so a crash or a hang in one is reported and the next
still runs. The steps share `--budget-min`: each may use what is left less the shares (SHARES) of the
steps after it, is killed at that timeout, and is skipped with a note when under MIN_STEP_S is left.
Without a CUDA device it refuses at once (exit 2).
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

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "experiments" / "results" / "gpu"
# Shares of the budget each step is guaranteed; one step may also use what an earlier one left unused.
SHARES = {"tests": 0.35, "bench": 0.35, "job": 0.30}
MIN_STEP_S = 30.0  # less than this cannot even load the model, so the step is skipped instead
TAIL_LINES = 40
# Repeats as the H100 sessions in docs/gpu.md ran it: their tables compare with this one, and the
# default grid (40 rows) stays within a few minutes.
BENCH_ARGS = ["--repeats", "5"]
# model.device=cuda, though `auto` picks CUDA here: a run that fell back to the CPU must fail, not report.
JOB_OVERRIDES = ["logger=none", "progress=false"]
# (label, overrides): the label names the run's folder and its column in the report; the table's ratio
# is the last run's over the first's, so fp32 graphs on / off (the earlier H100 runs were fp32, eager)
JOB_RUNS = (
    ("cuda-fp32-graphs-off", ["model.device=cuda", "model.dtype=float32", "executor.cuda_graphs=false"]),
    ("cpu-fp32", ["model.device=cpu", "model.dtype=float32"]),
    ("cuda-default", ["model.device=cuda"]),
    ("cuda-fp32-graphs-on", ["model.device=cuda", "model.dtype=float32", "executor.cuda_graphs=true"]),
)
# the pairs of runs whose outputs must be token-identical
COMPARED = (("cuda-fp32-graphs-off", "cuda-fp32-graphs-on"), ("cpu-fp32", "cuda-fp32-graphs-on"))
# pytest's summary-line words, in its own order
COUNT_ORDER = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warning", "error")


# -- results: what each step leaves for the report -------------------------------------------------


@dataclass(frozen=True)
class Skipped:
    """A step that did not run, and why (a --skip flag, the budget, nothing to run)."""

    reason: str


@dataclass(frozen=True)
class CommandRun:
    """One subprocess: `returncode` is None when it was killed at `timeout_s`."""

    command: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    timeout_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


@dataclass(frozen=True)
class Environment:
    gpu: str
    memory_gib: float
    capability: tuple[int, int]
    multiprocessors: int
    driver: str
    torch: str
    cuda: str
    nvrtc: str
    packages: dict[str, str]  # distribution -> version, or "not installed"
    python: str
    commit: str
    dirty: bool
    date: datetime


@dataclass(frozen=True)
class BenchResult:
    """A step that is one command."""

    run: CommandRun

    @property
    def wall_s(self) -> float:
        return self.run.wall_s


@dataclass(frozen=True)
class TestsResult(BenchResult):
    counts: dict[str, int]  # pytest's summary line, e.g. {"passed": 61, "skipped": 2}
    problems: list[str]  # the FAILED / ERROR lines of pytest's short summary
    skips: list[str]  # its SKIPPED lines, one per reason


@dataclass(frozen=True)
class JobRun:
    label: str
    run: CommandRun
    summary: dict[str, Any] | None  # its summary.json; None when the run wrote none


@dataclass(frozen=True)
class OutputComparison:
    """Two runs' requests.jsonl, token by token."""

    requests: int  # request ids in either run
    identical: int  # requests whose output token ids are the same in both
    tokens: int  # output tokens, the longer of the two outputs per request
    matching_tokens: int  # tokens before each request's first difference
    first_difference: str | None  # where the first differing request diverges; None if all identical


@dataclass(frozen=True)
class JobResult:
    runs: list[JobRun]
    # (first label, second label, their outputs compared) for each pair of COMPARED that both succeeded
    outputs: list[tuple[str, str, OutputComparison]]

    @property
    def wall_s(self) -> float:
        return sum(r.run.wall_s for r in self.runs)


Section = TestsResult | BenchResult | JobResult | Skipped


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
    return BenchResult(run_command([sys.executable, "experiments/kernel_bench.py", *BENCH_ARGS], timeout_s))


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


def run_job(timeout_s: float) -> JobResult:
    """The default job once per JOB_RUNS entry; each run may use its share of what is left."""
    start = time.monotonic()
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpu-report-") as tmp:
        for i, (label, overrides) in enumerate(JOB_RUNS):
            run_dir = Path(tmp) / label
            command = [sys.executable, "run.py", *JOB_OVERRIDES, *overrides, f"hydra.run.dir={run_dir}"]
            left = timeout_s - (time.monotonic() - start)
            runs.append(JobRun(label, run_command(command, left / (len(JOB_RUNS) - i)), read_summary(run_dir)))
        succeeded = {r.label for r in runs if r.run.ok}
        outputs = []
        for first, second in COMPARED:
            paths = [Path(tmp) / label / "requests.jsonl" for label in (first, second)]
            if {first, second} <= succeeded and all(p.is_file() for p in paths):
                outputs.append((first, second, compare_outputs(*map(read_outputs, paths))))
    return JobResult(runs, outputs)


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


# -- the report ------------------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *(line(r) for r in rows)]


def _fenced(text: str) -> list[str]:
    return ["```", text.rstrip("\n"), "```"]


def _tail(text: str) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-TAIL_LINES:])


def _shown_command(command: Sequence[str]) -> str:
    # the interpreter's path says nothing about the run; `python` reads as the reader would type it
    return " ".join(["python", *command[1:]] if command and command[0] == sys.executable else command)


def _status(run: CommandRun) -> str:
    if run.returncode is None:
        return f"killed at its timeout, {run.timeout_s:.0f} s"
    return f"exit {run.returncode}, {run.wall_s:.1f} s (timeout {run.timeout_s:.0f} s)"


def _command_line(run: CommandRun) -> str:
    return f"`{_shown_command(run.command)}`: {_status(run)}"


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts[k]} {k}" for k in COUNT_ORDER if k in counts) or "no pytest summary"


def _outcome(section: Section) -> str:
    """The one cell of the overview table that says how a step went."""
    if isinstance(section, Skipped):
        return f"skipped: {section.reason}"
    if isinstance(section, TestsResult):
        return _counts_text(section.counts) + ("" if section.run.returncode is not None else " (timed out)")
    if isinstance(section, BenchResult):
        return "ok" if section.run.ok else _status(section.run)
    ran = [r for r in section.runs if r.summary is not None]
    throughput = " / ".join(f"{r.label} {r.summary['output_tokens_per_s']:.1f} tok/s" for r in ran)
    agreement = "".join(f"; {a} vs {b}: {o.identical}/{o.requests} requests identical" for a, b, o in section.outputs)
    return (throughput or "no run finished") + agreement


def render_environment(env: Environment) -> list[str]:
    major, minor = env.capability
    rows = [
        ("GPU", env.gpu),
        ("memory", f"{env.memory_gib:.1f} GiB"),
        ("compute capability", f"{major}.{minor} (sm_{major}{minor}), {env.multiprocessors} SMs"),
        ("driver", env.driver),
        ("torch", f"{env.torch} (CUDA {env.cuda})"),
        ("NVRTC", env.nvrtc),
        *env.packages.items(),
        ("Python", env.python),
        ("commit", f"{env.commit}{' (with uncommitted changes)' if env.dirty else ''}"),
        ("date", env.date.isoformat(timespec="minutes")),
    ]
    return ["## Environment", "", *_table(("", ""), rows)]


def render_tests(tests: TestsResult) -> list[str]:
    lines = [_command_line(tests.run), ""]
    if tests.counts:
        shown = [k for k in COUNT_ORDER if k in tests.counts]
        lines += [*_table(shown, [[tests.counts[k] for k in shown]]), ""]
    if tests.skips:
        lines += ["Skipped:", "", *_fenced("\n".join(tests.skips)), ""]
    if tests.problems:
        lines += ["Failed:", "", *_fenced("\n".join(tests.problems)), ""]
    if not tests.run.ok:
        lines += ["Output's tail:", "", *_fenced(_tail(tests.run.stdout + tests.run.stderr)), ""]
    return lines


def render_bench(bench: BenchResult) -> list[str]:
    lines = [_command_line(bench.run), ""]
    if bench.run.stdout.strip():
        lines += [*_fenced(bench.run.stdout), ""]
    if not bench.run.ok:
        lines += ["stderr's tail:", "", *_fenced(_tail(bench.run.stderr)), ""]
    return lines


# (label, summary.json key, scale, format); paged/metrics.py and paged/summary.py define the keys
JOB_METRICS = [
    ("output tokens/s", "output_tokens_per_s", 1, "{:.1f}"),
    ("TPOT mean (ms)", "tpot_mean_s", 1000, "{:.2f}"),
    ("TPOT p99 (ms)", "tpot_p99_s", 1000, "{:.2f}"),
    ("ITL mean (ms)", "itl_mean_s", 1000, "{:.2f}"),
    ("ITL p99 (ms)", "itl_p99_s", 1000, "{:.2f}"),
    ("TTFT mean (s)", "ttft_mean_s", 1, "{:.3f}"),
    ("total time, first arrival to last finish (s)", "wall_time_s", 1, "{:.2f}"),
    ("host time of the run (s)", "host_time_s", 1, "{:.2f}"),
    ("load time, engine build (s)", "load_time_s", 1, "{:.2f}"),
    ("requests finished", "num_finished", 1, "{}"),
    ("engine steps", "num_engine_steps", 1, "{}"),
    ("CUDA-graph steps", "cuda_graph_steps", 1, "{}"),
    ("eager decode steps", "eager_decode_steps", 1, "{}"),
]


def _metric_cells(key: str, scale: float, fmt: str, summaries: Sequence[dict[str, Any] | None]) -> list[str]:
    """One value per run ("-" where absent: a failed run, or a key older trees do not write), then the
    ratio of the last to the first."""
    values = [s.get(key) if s is not None else None for s in summaries]
    cells = ["-" if v is None else fmt.format(v * scale) for v in values]
    first, last = values[0], values[-1]
    numbers = all(isinstance(v, int | float) for v in (first, last))
    return [*cells, f"{last / first:.2f}" if numbers and first else "-"]


def render_job(job: JobResult) -> list[str]:
    lines = []
    for r in job.runs:
        lines += [f"- {r.label}: {_command_line(r.run)}"]
    lines.append("")
    summaries = [r.summary for r in job.runs]
    if any(s is not None for s in summaries):
        ratio = f"{job.runs[-1].label} / {job.runs[0].label}"
        rows = [[label, *_metric_cells(key, scale, fmt, summaries)] for label, key, scale, fmt in JOB_METRICS]
        rows += [[label, *("-" if s is None else s.get(key, "-") for s in summaries), ""]
                 for label, key in (("attention", "attention_kernel"), ("executor", "executor_description"))]
        lines += [*_table(["metric", *(r.label for r in job.runs), ratio], rows), ""]
    for first, second, o in job.outputs:
        where = "" if o.first_difference is None else f"; the first difference: {o.first_difference}"
        lines += [f"Outputs of {first} and {second}: **{o.identical} of {o.requests} requests** have identical "
                  f"output token ids ({o.matching_tokens} of {o.tokens} tokens agree up to each request's first "
                  f"difference){where}.", ""]
    for r in job.runs:
        if not r.run.ok:
            lines += [f"{r.label}, stderr's tail:", "", *_fenced(_tail(r.run.stderr)), ""]
    return lines


def render_section(title: str, section: Section) -> list[str]:
    if isinstance(section, Skipped):
        body = [f"Skipped: {section.reason}.", ""]
    elif isinstance(section, TestsResult):
        body = render_tests(section)
    elif isinstance(section, BenchResult):
        body = render_bench(section)
    else:
        body = render_job(section)
    wall = "" if isinstance(section, Skipped) else f" ({section.wall_s:.0f} s)"
    return [f"## {title}{wall}", "", *body]


TITLES = ("1. CUDA tests", "2. Kernel benchmark", "3. The default job: CUDA graphs off / on, CUDA / CPU")


def render_report(env: Environment, tests: Section, bench: Section, job: Section, budget_min: float) -> str:
    """The whole report: the device, an overview, the environment, then one section per step."""
    sections = (tests, bench, job)
    used = sum(0.0 if isinstance(s, Skipped) else s.wall_s for s in sections)
    overview = [(title, _outcome(s), "-" if isinstance(s, Skipped) else f"{s.wall_s:.0f} s")
                for title, s in zip(TITLES, sections)]
    lines = [
        f"# GPU report: {env.gpu}",
        "",
        f"{env.date:%Y-%m-%d}, commit {env.commit}{' (dirty)' if env.dirty else ''}: "
        f"`python experiments/gpu_report.py` (`make gpu-report`), {used / 60:.1f} of {budget_min:g} minutes.",
        "",
        *_table(("section", "outcome", "wall time"), overview),
        "",
        *render_environment(env),
        "",
    ]
    for title, section in zip(TITLES, sections):
        lines += render_section(title, section)
    return "\n".join(lines).rstrip("\n") + "\n"


def report_name(env: Environment) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", env.gpu.lower()).strip("-")
    return f"{env.date:%Y-%m-%d}-{slug}.md"


# -- the command -----------------------------------------------------------------------------------


def run_steps(args: argparse.Namespace, budget: Budget) -> dict[str, Section]:
    """Run the steps not skipped by a flag, in order, each within its allowance of the budget."""
    runners = {"tests": run_tests, "bench": run_bench, "job": run_job}
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
    parser.add_argument("--skip-bench", action="store_true", help="no kernel benchmark")
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
