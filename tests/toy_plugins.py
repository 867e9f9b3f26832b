"""A toy allocator and a toy policy that plug in through config alone, proving the seams are open."""

from __future__ import annotations

from paged.memory import NaiveAllocator
from paged.request import Sequence
from paged.scheduler.policy import SchedulingPolicy


class CountingAllocator(NaiveAllocator):
    """Counts every allocation, so a test can see the engine really used it."""

    calls = 0

    def allocate(self) -> int:
        type(self).calls += 1
        return super().allocate()


class LongestPromptFirstPolicy(SchedulingPolicy):
    """The opposite of SJF: admit the longest prompt first; preempt the shortest."""

    def admission_key(self, seq: Sequence, now: float) -> tuple[int, int]:
        return (-seq.num_tokens, seq.seq_id)

    def victim_key(self, seq: Sequence, now: float) -> tuple[int, int]:
        return (-seq.num_tokens, seq.seq_id)
