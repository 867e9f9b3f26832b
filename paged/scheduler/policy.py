"""The policy seam: which waiting sequence is admitted first and which running one is preempted.

A new policy is one subclass plus one YAML in conf/scheduler whose `policy._target_` names it; the
YAML's other `policy.*` keys are its constructor settings. The scheduling core never changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from paged.request import Sequence


class SchedulingPolicy(ABC):
    @abstractmethod
    def admission_key(self, seq: Sequence, now: float) -> Any:
        """Waiting sequences are admitted in ascending key order."""

    @abstractmethod
    def victim_key(self, seq: Sequence, now: float) -> Any:
        """When blocks run out, the running sequence with the largest key is preempted."""

    def order(self, waiting: list[Sequence], now: float) -> list[Sequence]:
        return sorted(waiting, key=lambda s: self.admission_key(s, now))

    def choose_victim(self, candidates: list[Sequence], now: float) -> Sequence:
        return max(candidates, key=lambda s: self.victim_key(s, now))
