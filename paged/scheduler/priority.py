"""Per-request priority (lower value first, as in vLLM), ties by arrival; lowest priority is preempted."""

from __future__ import annotations

from paged.request import Sequence
from paged.scheduler.policy import SchedulingPolicy


class PriorityPolicy(SchedulingPolicy):
    def admission_key(self, seq: Sequence, now: float) -> tuple[int, float, int]:
        return (seq.request.priority, seq.request.arrival_time, seq.seq_id)

    def victim_key(self, seq: Sequence, now: float) -> tuple[int, float, int]:
        return (seq.request.priority, seq.request.arrival_time, seq.seq_id)
