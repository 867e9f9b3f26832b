"""The engine loop: schedule, execute, update, record.

Sequence state changes only in the scheduler (`update_from_output`); the executor only computes
and samples; the engine wires them together on the executor's clock and records each step.
"""

from __future__ import annotations

from collections.abc import Callable

from paged.executor.base import Executor
from paged.metrics import MetricsRecorder
from paged.request import Request
from paged.scheduler.core import Scheduler
from paged.step import ExecutorOutput


class Engine:
    def __init__(self, executor: Executor, scheduler: Scheduler, metrics: MetricsRecorder | None = None) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.metrics = metrics or MetricsRecorder()
        self.clock = executor.clock

    def add_request(self, request: Request) -> None:
        self.metrics.on_add(request)
        self.scheduler.add_request(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Request]:
        """Run one iteration; returns the requests that finished (or were aborted) in it."""
        start = self.clock.now()
        sched = self.scheduler.schedule(start)
        self.metrics.on_scheduled(sched, self.scheduler.waiting)
        # a step whose only sequence was swapped out still moves its blocks
        busy = sched.scheduled or sched.blocks_to_swap_out or sched.blocks_to_swap_in
        output = self.executor.execute(sched) if busy else ExecutorOutput([])
        finished = self.scheduler.update_from_output(sched, output, self.clock.now())
        if sched.scheduled:
            self.metrics.on_step(sched, output, self.scheduler.stats(), start, self.clock.now())
        return finished

    def run_until_done(self, on_step: Callable[[list[Request]], None] | None = None) -> None:
        while self.has_unfinished:
            finished = self.step()
            if on_step is not None:
                on_step(finished)
