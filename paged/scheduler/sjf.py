"""Shortest job first, with aging so long prompts cannot starve; the longest remaining job is preempted.

A waiting sequence's effective length shrinks by `aging_tokens_per_s` for every second it has
waited, so any request eventually ranks ahead of newly arriving short ones.
"""

from __future__ import annotations

from paged.request import Sequence
from paged.scheduler.policy import SchedulingPolicy


class SJFPolicy(SchedulingPolicy):
    def __init__(self, aging_tokens_per_s: float = 256.0) -> None:
        if aging_tokens_per_s < 0:
            raise ValueError(f"aging_tokens_per_s must be >= 0, got {aging_tokens_per_s!r}")
        self.aging_tokens_per_s = aging_tokens_per_s

    def admission_key(self, seq: Sequence, now: float) -> tuple[float, float, int]:
        waited = max(0.0, now - seq.request.arrival_time)
        effective = seq.num_tokens - self.aging_tokens_per_s * waited
        return (effective, seq.request.arrival_time, seq.seq_id)

    def victim_key(self, seq: Sequence, now: float) -> tuple[int, float, int]:
        remaining = seq.request.params.max_tokens - seq.num_output_tokens
        return (remaining, seq.request.arrival_time, seq.seq_id)
