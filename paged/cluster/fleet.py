"""A fleet of replicas behind a router, driven as one engine.

`paged.engine.runner.drive` submits a request once the fleet's clock reaches its arrival, steps while any
replica holds work and aborts all on a stop; the fleet routes each submitted request and decides
which replica steps next. Simulated replicas share one timeline: the fleet's time is the earliest
clock among the busy replicas, and that replica steps next, so events happen in time order as if
the replicas ran side by side. Real replicas in this process take turns on the wall clock.

The replicas record into one `MetricsRecorder` (the fleet's), so fleet-level latencies and
throughput are computed over every request as for one engine; each replica keeps its own row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from paged.cluster.replica import Replica
from paged.cluster.replica_queue import ReplicaQueue
from paged.cluster.router import Router
from paged.engine.held_steps import HeldSteps
from paged.engine.metrics import MetricsRecorder
from paged.executor.base import Executor
from paged.request import Request
from paged.scheduler.core import SchedulerCounters
from paged.step import KVStats
from paged.utils.clock import Clock, WallClock


class FleetClock(Clock):
    """Simulated: the earliest clock among busy replicas (the next event), else the time the fleet
    idled to. Wall: the wall clock, shared by every replica once reset together."""

    def __init__(self, fleet: Fleet, simulated: bool) -> None:
        self.fleet = fleet
        self.simulated = simulated
        self._wall = WallClock()
        self._idle = 0.0

    def now(self) -> float:
        if not self.simulated:
            return self._wall.now()
        t = self.fleet.next_step_time()
        return self._idle if t is None else t

    def reset(self) -> None:
        self._wall.reset()
        self._idle = 0.0
        for replica in self.fleet.replicas:
            replica.clock.reset()

    def wait_until(self, t: float) -> None:
        if self.simulated:
            self._idle = max(self._idle, t)
        else:
            self._wall.wait_until(t)


# held steps past which the fleet counts those every replica has passed (their memory is bounded, and
# each count merges many)
_HELD_STEPS = 1024


class Fleet:
    """Replicas behind a router. Public state: `replicas`, `router`, `metrics` (the fleet's
    recorder), `clock`; `live` lists the replicas still alive.

    On a simulated clock the busy replicas wait in a heap by the time each steps next, so a step
    costs O(log replicas): a replica's clock (it moves only when it steps, or when it takes a
    request while idle), or, for a replica inside a fast-forward window, a lower bound of its
    window's end (`Replica.next_event`). Such a replica **lags**: its window steps run only when
    something needs them: its window's end, a request routed to it, or a router's read they could
    change (`Replica.reads_at`: the replica runs the steps that start before the arrival first,
    `run_window_to`). It changes only by its own steps and what is routed to it, so at every arrival
    the router reads what stepping would show it, and the steps run in the same order per
    replica; the fleet's step statistics are held until every replica has passed them, and
    counted in stepping's order (`HeldSteps`). A fleet lags when every replica can
    (`Replica.can_lag`: a simulated engine with fast-forward) and no step record is kept or
    listened to (those are made in step order)."""

    def __init__(self, replicas: list[Replica], router: Router, metrics: MetricsRecorder | None = None) -> None:
        if not replicas:
            raise ValueError("a fleet needs at least one replica")
        self.replicas = replicas
        self.router = router
        self.metrics = metrics or MetricsRecorder()
        self.clock: Clock = FleetClock(self, simulated=replicas[0].clock.simulated)
        self._turn = 0
        self._queue = ReplicaQueue()  # simulated: each busy replica by when it steps next
        self._held = HeldSteps(self.metrics.step_stats)
        self._lags: bool | None = None  # decided at the first request (listeners are added before it)
        self._now = 0.0  # simulated: when the latest step popped from the queue starts
        self._release_at = _HELD_STEPS  # held steps at which the next count comes
        for replica in replicas:
            replica.hold_steps(self._held)

    @property
    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]

    @property
    def has_unfinished(self) -> bool:
        if self.clock.simulated:
            return bool(self._queue)
        return any(r.has_unfinished for r in self.live)

    def next_step_time(self) -> float | None:
        """Simulated: when the busy replica that steps next does (a lagging one: a lower bound);
        None when none is busy."""
        return self._queue.peek()

    @property
    def lags(self) -> bool:
        """Whether its replicas lag inside their windows (the class docstring)."""
        if self._lags is None:
            self._lags = (self.clock.simulated and all(r.can_lag for r in self.replicas)
                          and not self.metrics.records_steps)
        return self._lags

    def add_request(self, request: Request) -> None:
        live = self.live
        if not self.lags:
            replica = self.router.route(request, live)
            was_busy = replica.has_unfinished
            replica.add_request(request)
            if self.clock.simulated and not was_busy:
                self._queue.push(replica.index, replica.clock.now())
            return
        # the router reads each replica as of the arrival (one released at once, as of now)
        t = max(request.arrival_time, self._now)
        for r in live:
            r.reads_at = t
        try:
            replica = self.router.route(request, live)
        finally:
            for r in live:
                r.reads_at = None
        replica.run_window_to(t)
        replica.add_request(request)
        self._queue.push(replica.index, replica.clock.now())  # its window ends here

    def step(self, until: float | None = None, releases: bool = False) -> list[Request]:
        """Step the replica whose turn it is: the earliest busy one on a simulated clock, else the
        next busy one in turn. Returns the requests it finished.

        On a simulated clock, `until` is the next arrival (nothing is routed before it): the
        replica runs every fast-forward step that starts before it, since the routers read the
        replicas only at arrivals, and a replica changes only by its own steps and what is routed
        to it. With `releases` (a finishing step may release a follow-up, due at its end or later),
        only the steps that start before the next busy replica's clock, as stepping would run
        them. The steps run ahead of others' are counted in their turn (`HeldSteps`)."""
        if self.clock.simulated:
            start, index = self._queue.pop()
            self._now = start
            replica = self.replicas[index]
            if len(self._held) >= self._release_at:
                self._held.release(*self._next_step(start, index))
                # a replica lagging far behind keeps many held: count again once they doubled
                self._release_at = max(_HELD_STEPS, 2 * len(self._held))
            if until is not None and releases and self._queue:
                until = min(until, self._queue.peek())  # type: ignore[type-var]
            finished = replica.step(until)
            if replica.has_unfinished:
                self._queue.push(index, replica.next_event() if self.lags else replica.clock.now())
            elif not self._queue:
                self._held.release_all()
            return finished
        busy = [r for r in self.live if r.has_unfinished]
        replica = busy[self._turn % len(busy)]
        self._turn += 1
        return replica.step()

    def _next_step(self, start: float, index: int) -> tuple[float, int]:
        """(start, replica) of the earliest step still to run, `index` popped at `start` to step:
        no held step after it can be counted yet. A lagging replica's key is not its clock."""
        if not self.lags:
            return start, index
        return min((self.replicas[i].clock.now(), i) for i in (index, *self._queue.indices()))

    def request_counts(self) -> tuple[int, int]:
        """Requests running and waiting over the live replicas (`Engine.request_counts`)."""
        counts = [r.request_counts() for r in self.live]
        return sum(running for running, _ in counts), sum(waiting for _, waiting in counts)

    def abort(self, request: Request, reason: str) -> None:
        """Abort `request` on the replica it was routed to (the one whose `held` has it), freeing its
        blocks there; that replica's next step returns it, with `reason` (`Engine.abort`). A request
        no replica holds (finished, or never submitted) is left as it is."""
        replica = next((r for r in self.live if request in r.held), None)
        if replica is not None:
            if self.lags:
                replica.run_window_to(self._now)
                self._queue.push(replica.index, replica.clock.now())  # its window ends here
            replica.abort(request, reason)

    def abort_all(self, reason: str) -> list[Request]:
        self._queue.clear()
        self._held.release_all()
        return [request for replica in self.live for request in replica.abort_all(reason)]

    def shutdown(self) -> None:
        """Release what the replicas hold outside this process (tensor-parallel workers; a Ray
        fleet's actors). Their rows and stats stay readable."""
        for replica in self.replicas:
            replica.shutdown()

    # -- what the summary asks, over the whole fleet ----------------------------------------------

    def kv_stats(self) -> KVStats:
        """Every replica's pool added up (its block size is theirs)."""
        stats = [r.kv_stats() for r in self.replicas]
        sums = {
            f.name: sum(getattr(s, f.name) for s in stats)
            for f in dataclasses.fields(KVStats) if f.name not in ("block_size", "num_tokens_held")
        }
        # a replica without KV groups leaves `num_tokens_held` unset: its `tokens_held` is its slots
        return KVStats(block_size=stats[0].block_size, num_tokens_held=sum(s.tokens_held for s in stats), **sums)

    @property
    def counters(self) -> SchedulerCounters:
        total = SchedulerCounters()
        for replica in self.replicas:
            for f in dataclasses.fields(SchedulerCounters):
                setattr(total, f.name, getattr(total, f.name) + getattr(replica.counters, f.name))
        return total

    @property
    def num_swap_fallbacks(self) -> int:
        return sum(r.num_swap_fallbacks for r in self.replicas)

    @property
    def executor(self) -> Executor:
        """The first replica's executor: every replica runs the same config."""
        return self.replicas[0].executor

    @property
    def caches_prefixes(self) -> bool:
        return self.replicas[0].caches_prefixes

    def plugin_classes(self) -> dict[str, str]:
        return self.replicas[0].plugin_classes() | {"router": f"{type(self.router).__module__}."
                                                              f"{type(self.router).__qualname__}"}

    def replica_rows(self) -> list[dict[str, Any]]:
        return [r.row() for r in self.replicas]
