"""A launched step's output, as `Executor.launch` returns it: already on the host, or on its way.

Under async scheduling (`scheduler.async_scheduling`, `paged.engine.async_step`) the engine launches
step N+1 before it reads step N's tokens. A step whose output the executor already holds (it ran to
its end, as every step of an executor without async support does, and a step with a request whose
tokens cannot lag: `paged.step.tokens_can_lag`) is `ReadyOutput`: the engine applies it before it
schedules the next. One that `lags` leaves its sampled tokens on the device, where the next step's
inputs read them, and its `result` waits only for their copy to the host.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from paged.step import ExecutorOutput


class PendingOutput(ABC):
    # True: the step's sampled tokens are still on the device; the scheduler gave its sequences
    # placeholders for them (`Scheduler.commit_scheduled`)
    lags: bool = False

    @abstractmethod
    def result(self) -> ExecutorOutput:
        """The step's output on the host; waits for the device where it must."""


class ReadyOutput(PendingOutput):
    def __init__(self, output: ExecutorOutput) -> None:
        self.output = output

    def result(self) -> ExecutorOutput:
        return self.output
