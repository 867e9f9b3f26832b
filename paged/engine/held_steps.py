"""Steps counted ahead of their turn, held until every step before them is counted.

A fleet on a simulated clock steps its replicas in time order: the one whose clock is earliest,
ties to the lower index. A replica that runs several fast-forward steps in one call (up to the
fleet's next arrival), or that lags behind the fleet inside its window (`Fleet`), runs some of
them before other replicas' earlier steps; their statistics go into one `StepStats`, whose float
sums and means depend on the order of the steps. So every replica's steps are held here, in its
own order, and counted once no step still to run can come before them, in stepping's order: by
start, ties to the lower replica.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from operator import itemgetter
from typing import Any

from paged.engine.step_stats import StepStats

# takes a step's statistics (its start, its `decode_step`) to count later, in its turn
Hold = Callable[[float, tuple[Any, ...]], None]

_START = itemgetter(0)


class HeldSteps:
    """Steps (as `paged.engine.step_stats.decode_step` gives them) waiting for their turn in `stats`:
    per replica a run of (start, step) in its step order, merged when released."""

    def __init__(self, stats: StepStats) -> None:
        self.stats = stats
        self._runs: dict[int, list[tuple[float, tuple[Any, ...]]]] = {}
        self._num_held = 0

    def __len__(self) -> int:
        return self._num_held

    def hold(self, start: float, replica: int, step: tuple[Any, ...]) -> None:
        run = self._runs.get(replica)
        if run is None:
            run = self._runs[replica] = []
        run.append((start, step))
        self._num_held += 1

    def release(self, start: float, replica: int) -> None:
        """Count the held steps that come before a step of `replica` starting at `start`."""
        due: list[tuple[float, int, int, tuple[Any, ...]]] = []
        for r, run in self._runs.items():
            # a lower replica's step at `start` comes before, a higher one's after
            cut = (bisect_right if r < replica else bisect_left)(run, start, key=_START)
            if cut:
                due += [(s, r, i, step) for i, (s, step) in enumerate(run[:cut])]
                del run[:cut]
        self._count(due)

    def release_all(self) -> None:
        due = [(s, r, i, step) for r, run in self._runs.items() for i, (s, step) in enumerate(run)]
        self._runs.clear()
        self._count(due)

    def _count(self, due: list[tuple[float, int, int, tuple[Any, ...]]]) -> None:
        # (start, replica, position in its run) is unique: the sort never compares two steps
        due.sort()
        count = self.stats.count
        for item in due:
            count(item[3])
        self._num_held -= len(due)
