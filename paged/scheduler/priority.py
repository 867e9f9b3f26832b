"""Per-request priority (lower value first, as in vLLM), ties by arrival; the lowest priority is
preempted, and with `preempt` a waiting request displaces running ones of lower priority.

The preemption follows vLLM V0's `_schedule_priority_preemption`: while the most important waiting
request does not fit, the least important running one that it outranks is preempted. vLLM compares
(priority, arrival time), so there an earlier-arriving waiting request of *equal* priority (say one
that was itself preempted) displaces a later running one, and two such requests can take turns
preempting each other. Here a waiting request outranks a running one only on a strictly lower
priority value: equal priorities never preempt, they wait by arrival as in FCFS.
"""

from __future__ import annotations

from paged.request import Sequence
from paged.scheduler.policy import SchedulingPolicy


class PriorityPolicy(SchedulingPolicy):
    step_invariant = True
    def __init__(self, preempt: bool = True) -> None:
        if not isinstance(preempt, bool):
            raise ValueError(f"preempt must be true or false, got {preempt!r}")
        self.preemptive = preempt

    def admission_key(self, seq: Sequence, now: float) -> tuple[int, float, int]:
        return (seq.request.priority, seq.request.arrival_time, seq.seq_id)

    def victim_key(self, seq: Sequence, now: float) -> tuple[int, float, int]:
        return (seq.request.priority, seq.request.arrival_time, seq.seq_id)

    def outranks(self, waiting: Sequence, running: Sequence, now: float) -> bool:
        return waiting.request.priority < running.request.priority
