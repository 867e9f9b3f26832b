"""The engine's step under async scheduling (`scheduler.async_scheduling`): the host a step ahead.

A synchronous step schedules, waits for the device to compute and sample, then applies the tokens;
on a GPU the device idles while the host schedules and applies, and the host waits while the device
computes. Here each call schedules and launches step N+1 first, and only then reads and applies
step N (vLLM V1's async scheduling, SGLang's overlap scheduler): N+1's sequences read the tokens N
sampled on the device, through the placeholders the scheduler gave them (`commit_scheduled`), and
the host learns N's tokens, stops and finished requests one step later (`update_lagged`).

A step whose output the executor already holds (`ReadyOutput`: a request whose tokens cannot lag,
or swaps only) is applied at once, before the next is scheduled, as the synchronous engine would.
Aborts and interrupts lose nothing: `settle` applies the step in flight first.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from paged.engine.metrics import MetricsRecorder
from paged.executor.base import Executor
from paged.executor.pending import PendingOutput, ReadyOutput
from paged.request import Request
from paged.scheduler.core import Scheduler
from paged.scheduler.lagged_update import Committed
from paged.step import ExecutorOutput, SchedulerOutput


@dataclass
class _Launched:
    sched: SchedulerOutput
    pending: PendingOutput
    committed: Committed | None  # None: a ready step, applied through `update_from_output`
    start: float
    end: float = 0.0  # when the engine step that launched it returned


class AsyncStep:
    """The step strategy of an `Engine` with async scheduling, over its parts."""

    def __init__(self, scheduler: Scheduler, executor: Executor, metrics: MetricsRecorder) -> None:
        self.scheduler, self.executor, self.metrics = scheduler, executor, metrics
        self.clock = executor.clock
        self._in_flight: _Launched | None = None
        self._settled: list[Request] = []  # finished while settling: the next step returns them
        self.num_lagged_steps = 0  # steps whose tokens were applied a step late (the others ran to their end)

    @property
    def busy(self) -> bool:
        """Whether a step is in flight or finished requests wait to be returned."""
        return self._in_flight is not None or bool(self._settled)

    def step(self) -> list[Request]:
        """Schedule and launch the next step, then apply the one before; returns the requests that
        finished (or were aborted) in the applied steps."""
        scheduler, clock = self.scheduler, self.clock
        start = clock.now()
        sched = scheduler.schedule(start)
        self.metrics.on_scheduled(sched, scheduler.waiting)
        busy = sched.scheduled or sched.blocks_to_swap_out or sched.blocks_to_swap_in or sched.blocks_to_offload
        pending = self.executor.launch(sched) if busy else ReadyOutput(ExecutorOutput([]))
        launched = _Launched(sched, pending, scheduler.commit_scheduled(sched) if pending.lags else None, start)
        finished, self._settled = self._settled, []
        finished += self._apply()
        self._in_flight = launched
        if pending.lags:
            self.num_lagged_steps += 1
            launched.end = clock.now()
        else:
            finished += self._apply()
        return finished

    def settle(self) -> list[Request]:
        """Apply the step in flight now (before an abort); returns the requests it finished, which
        the next `step` returns too."""
        finished = self._apply()
        self._settled += finished
        return finished

    def _apply(self) -> list[Request]:
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            return []
        scheduler = self.scheduler
        output = launched.pending.result()
        now = self.clock.now()
        sched = launched.sched
        if launched.committed is not None:
            finished = scheduler.update_lagged(sched, output, launched.committed, now)
        else:
            finished = scheduler.update_from_output(*_without_finished(sched, output), now)
        if sched.scheduled:
            self.metrics.on_step(sched, output, scheduler.stats(), launched.start, launched.end or now)
        return finished


def _without_finished(sched: SchedulerOutput, output: ExecutorOutput) -> tuple[SchedulerOutput, ExecutorOutput]:
    """A ready step without the rows of sequences that the lagged step before it finished (or that
    were aborted since): their tokens are past their end."""
    keep = [i for i, item in enumerate(sched.scheduled) if not item.seq.is_finished]
    if len(keep) == len(sched.scheduled):
        return sched, output

    def kept(values: list | None) -> list | None:
        return None if values is None else [values[i] for i in keep]

    rows = dataclasses.replace(sched, scheduled=[sched.scheduled[i] for i in keep])
    return rows, dataclasses.replace(output, sampled=kept(output.sampled), logprobs=kept(output.logprobs),
                                     top_logprobs=kept(output.top_logprobs))

