"""The engine's time: seconds since an origin, for arrivals, step times and request latencies.

Real executors run on the wall clock; a simulated executor brings a virtual clock that its cost
model advances, so the same engine and runner measure simulated seconds.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod


class Clock(ABC):
    # True when `now()` is simulated time rather than the wall clock
    simulated: bool = False

    @abstractmethod
    def now(self) -> float:
        """Seconds since the origin."""

    @abstractmethod
    def reset(self) -> None:
        """Move the origin to now (a run starts its clock at its first arrival)."""

    @abstractmethod
    def wait_until(self, t: float) -> None:
        """Idle until `now() >= t`; nothing is running meanwhile."""


class WallClock(Clock):
    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def reset(self) -> None:
        self._t0 = time.perf_counter()

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))


class VirtualClock(Clock):
    """Simulated seconds: only `advance` (a step's modelled duration) and `wait_until` (idle until
    the next arrival, at no cost) move it."""

    simulated = True

    def __init__(self) -> None:
        self._now = 0.0

    def now(self) -> float:
        return self._now

    def reset(self) -> None:
        self._now = 0.0

    def wait_until(self, t: float) -> None:
        self._now = max(self._now, t)

    def advance(self, seconds: float) -> None:
        assert seconds >= 0.0, seconds
        self._now += seconds
