"""The policy seam: which waiting sequence is admitted first, which running one is preempted, and
(for a preemptive policy) which running request a waiting one may displace.

A new policy is one subclass plus one YAML in conf/scheduler whose `policy._target_` names it; the
YAML's other `policy.*` keys are its constructor settings. The scheduling core never changes: it
calls `bind` once, `on_add` when a request is queued, `order` / `choose_victim` / `outranks` while it
schedules, `on_scheduled` with every step it hands the executor, and `on_finished` when a request
ends (finished or aborted). Policies with state (service counters, queue levels, length
predictors) keep it per request and drop it in `on_finished`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from paged.request import Request, Sequence

if TYPE_CHECKING:
    from paged.memory import BlockManager
    from paged.step import SchedulerOutput


class SchedulingPolicy(ABC):
    # True: a waiting request that `outranks` running ones may preempt them to be admitted (vLLM
    # V0's priority preemption); the core then asks `outranks` before each such preemption. A class
    # default that a policy may set per instance from a setting.
    preemptive: bool = False

    # True: over decode steps in which nothing else changes (no arrival, finish or preemption) the
    # policy's state does not change either (`on_scheduled` keeps none), so a simulated engine may
    # fast-forward them (paged/engine/fast_forward.py); False: it must see every step; None (a policy
    # that does not say): stepped one iteration at a time, and the log says so once
    step_invariant: bool | None = None

    block_manager: BlockManager | None = None

    def bind(self, block_manager: BlockManager) -> None:
        """Called once by the scheduler: the cache a policy may query (e.g. cached prefix lengths)."""
        self.block_manager = block_manager

    @abstractmethod
    def admission_key(self, seq: Sequence, now: float) -> Any:
        """Waiting sequences are admitted (and running ones served) in ascending key order."""

    @abstractmethod
    def victim_key(self, seq: Sequence, now: float) -> Any:
        """When blocks run out, the running sequence with the largest key is preempted."""

    def order(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        return sorted(seqs, key=lambda s: self.admission_key(s, now))

    def choose_victim(self, candidates: list[Sequence], now: float) -> Sequence:
        return max(candidates, key=lambda s: self.victim_key(s, now))

    def outranks(self, waiting: Sequence, running: Sequence, now: float) -> bool:
        """Whether `waiting` may preempt `running` to be admitted; only asked when `preemptive`."""
        return False

    def on_add(self, request: Request, now: float) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """A request was queued."""

    def on_scheduled(self, out: SchedulerOutput, now: float) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """The scheduler hands `out` to the executor: the service each sequence gets this step is
        `num_new_tokens` of its `ScheduledSeq` (a prefill chunk, or 1 for a decode)."""

    def on_finished(self, request: Request, now: float) -> None:  # noqa: B027 - an optional hook, a no-op by default
        """`request` finished or was aborted: forget what was kept for it."""
