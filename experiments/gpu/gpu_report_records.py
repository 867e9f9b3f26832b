"""What the steps of experiments/gpu/gpu_report.py leave for the report: one record per step (or
`Skipped`), filled by the runner from its subprocesses and rendered by gpu_report_render.py."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


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
class TestsResult:
    run: CommandRun
    counts: dict[str, int]  # pytest's summary line, e.g. {"passed": 61, "skipped": 2}
    problems: list[str]  # the FAILED / ERROR lines of pytest's short summary
    skips: list[str]  # its SKIPPED lines, one per reason

    @property
    def wall_s(self) -> float:
        return self.run.wall_s


@dataclass(frozen=True)
class BenchRun:
    label: str  # what it measures, e.g. "decode attention"
    run: CommandRun


@dataclass(frozen=True)
class BenchResult:
    """The benchmark step: one run per benchmark, each whatever became of the ones before it."""

    runs: list[BenchRun]

    @property
    def wall_s(self) -> float:
        return sum(r.run.wall_s for r in self.runs)


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
class TtftRatio:
    """TTFT mean of the run `slower` (the torch kernels) over that of `faster` (ours), against `target`."""

    slower: str
    faster: str
    target: float


@dataclass(frozen=True)
class SimComparison:
    """The run `real` against the simulator's run `simulated` of the same model and workload: output
    tok/s within `target` (a fraction) of the simulator's."""

    real: str
    simulated: str
    target: float


@dataclass(frozen=True)
class JobResult:
    runs: list[JobRun]
    # (first label, second label, their outputs compared) for each pair of COMPARED that both succeeded
    outputs: list[tuple[str, str, OutputComparison]]
    ttft: TtftRatio | None = None  # the TTFT ratio to state, where the job has both runs
    ratio: tuple[str, str] | None = None  # the table's ratio column, numerator over denominator (None: last / first)
    sim: SimComparison | None = None  # the real run to state against the simulator's

    @property
    def wall_s(self) -> float:
        return sum(r.run.wall_s for r in self.runs)


Section = TestsResult | BenchResult | JobResult | Skipped
