"""First come, first served; the newest running sequence is preempted (vLLM V0/V1 default)."""

from __future__ import annotations

from paged.request import Sequence
from paged.scheduler.policy import SchedulingPolicy


class FCFSPolicy(SchedulingPolicy):
    step_invariant = True
    def admission_key(self, seq: Sequence, now: float) -> tuple[float, int]:
        return (seq.request.arrival_time, seq.seq_id)

    def victim_key(self, seq: Sequence, now: float) -> tuple[float, int]:
        return (seq.request.arrival_time, seq.seq_id)
