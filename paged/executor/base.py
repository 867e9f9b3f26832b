"""The executor seam: the real model and the simulated GPU both implement `Executor`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from paged.scheduler.output import SchedulerOutput


@dataclass
class ExecutorOutput:
    """One list of sampled token ids per scheduled sequence, in `SchedulerOutput.scheduled` order."""

    sampled: list[list[int]]
    num_computed_tokens: int
    step_time_s: float


class Executor(Protocol):
    eos_token_id: int | None

    def execute(self, sched: SchedulerOutput) -> ExecutorOutput: ...
