"""Steps counted ahead of their turn, held until every step before them is counted.

A fleet on a simulated clock steps its replicas in time order: the one whose clock is earliest,
ties to the lower index. A replica that runs several fast-forward steps in one call (up to the
fleet's next arrival) runs some of them before other replicas' earlier steps; their statistics go
into one `StepStats`, whose float sums and means depend on the order of the steps. So those steps
are held here, by (start, replica), and counted once the fleet's next step starts after them: the
order stepping counts them in.
"""

from __future__ import annotations

import heapq
from itertools import count
from typing import Any

from paged.engine.step_stats import StepStats


class HeldSteps:
    """Steps (as `paged.engine.step_stats.decode_step` gives them) waiting for their turn in `stats`."""

    def __init__(self, stats: StepStats) -> None:
        self.stats = stats
        self._held: list[tuple[float, int, int, tuple[Any, ...]]] = []  # a heap by (start, replica, arrival order)
        self._order = count()

    def hold(self, start: float, replica: int, step: tuple[Any, ...]) -> None:
        heapq.heappush(self._held, (start, replica, next(self._order), step))

    def release(self, start: float, replica: int) -> None:
        """Count the held steps that come before a step of `replica` starting at `start`."""
        held = self._held
        while held and (held[0][0], held[0][1]) < (start, replica):
            self.stats.count(heapq.heappop(held)[3])

    def release_all(self) -> None:
        held = self._held
        while held:
            self.stats.count(heapq.heappop(held)[3])
