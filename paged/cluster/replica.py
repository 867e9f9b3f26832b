"""One replica of the engine, as a fleet drives it and as a router sees it.

`ReplicaView` is the router's whole view of a replica: its load now and how much of a prompt its
prefix cache already holds. `Replica` adds what the fleet does with it: submit, step, finish.
`LocalReplica` is an engine in this process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from paged.engine.engine import Engine
from paged.engine.fast_forward import FastForward
from paged.engine.held_steps import HeldSteps
from paged.executor.base import Executor
from paged.request import Request
from paged.scheduler.core import SchedulerCounters
from paged.step import KVStats
from paged.utils.clock import Clock

# the load numbers every replica reports: what a `least-loaded` router may balance
LOAD_METRICS = ("outstanding_tokens", "num_requests", "num_waiting", "kv_usage")


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica's load now. `outstanding_tokens`: prompt tokens plus `max_tokens` of the requests
    it holds (work assigned and not finished); `num_requests`: those requests; `num_waiting`: those
    not yet admitted; `kv_usage`: allocated KV blocks / total."""

    outstanding_tokens: int
    num_requests: int
    num_waiting: int
    kv_usage: float

    def metric(self, name: str) -> float:
        return float(getattr(self, name))


class ReplicaView(ABC):
    """What a router sees of one replica."""

    index: int
    block_size: int  # tokens per KV block: the granularity of its prefix cache

    @abstractmethod
    def load(self) -> ReplicaLoad: ...

    def load_metric(self, name: str) -> float:
        """One of `load()`'s numbers (`LOAD_METRICS`), for a router that balances on one: a replica
        may know it without taking the whole load (a lagging one, without running its steps)."""
        return self.load().metric(name)

    @abstractmethod
    def cached_prefix_blocks(self, chain: list[bytes]) -> int:
        """Blocks from the start of `chain` (a prompt's `paged.memory.hashing.prompt_block_hashes`)
        that the replica's prefix cache holds now (0 when it reports none)."""


class Replica(ReplicaView):
    """A replica the fleet submits to and steps. Tracks the requests it holds, so that its load is
    known without asking the engine, and what it served (`num_routed`, `kv_usage_sum` per step)."""

    def __init__(self, index: int, block_size: int) -> None:
        self.index = index
        self.block_size = block_size
        self.alive = True
        self.held: dict[Request, int] = {}  # unfinished requests -> their outstanding-token cost
        self.outstanding_tokens = 0
        self.num_routed = 0
        self.num_finished = 0
        self.num_aborted = 0
        self.num_steps = 0
        self.kv_usage_sum = 0.0
        self.kv_usage_max = 0.0
        # a lagging fleet's arrival: the time the router reads this replica at (None: now)
        self.reads_at: float | None = None

    @property
    @abstractmethod
    def clock(self) -> Clock: ...

    @property
    def can_lag(self) -> bool:
        """Whether it can lag behind its fleet's clock inside a fast-forward window (`Fleet`):
        it knows a lower bound of its next other step (`next_event`) and runs its window steps up
        to a time when asked (`run_window_to`)."""
        return False

    def next_event(self) -> float:
        """A lower bound of when its next step that is not a window step starts (its clock when
        it cannot lag)."""
        return self.clock.now()

    def run_window_to(self, t: float) -> None:  # noqa: B027 - optional hook
        """Run its window steps that start before `t`; nothing where it cannot lag."""

    def load_metric(self, name: str) -> float:
        # the requests it holds and their tokens change only when it takes or finishes one
        if name == "num_requests":
            return float(len(self.held))
        if name == "outstanding_tokens":
            return float(self.outstanding_tokens)
        return self.load().metric(name)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.held)

    def add_request(self, request: Request) -> None:
        cost = request.num_prompt_tokens + (request.params.max_tokens or 0)
        self.held[request] = cost
        self.outstanding_tokens += cost
        self.num_routed += 1
        self._submit(request)

    def step(self, until: float | None = None) -> list[Request]:
        """Run one step, and with a horizon `until` (the fleet's next arrival) the fast-forward
        steps after it that start before it; returns the requests they finished or aborted."""
        finished = self._step() if until is None else self._step_until(until)
        self._count_steps(finished)
        return finished

    def _count_steps(self, finished: list[Request]) -> None:
        """Each step's record of the latest call (the last one's with what it finished)."""
        for usage in self._usages_before_last():
            self.num_steps += 1
            self.kv_usage_sum += usage
            self.kv_usage_max = max(self.kv_usage_max, usage)
        self._record(finished)

    def hold_steps(self, held: HeldSteps) -> None:  # noqa: B027 - optional hook
        """Count the statistics of the steps a call runs after its first through `held` (they run
        ahead of other replicas' steps); nothing to do where a call runs one step."""

    def _step_until(self, until: float) -> list[Request]:
        return self._step()

    def _usages_before_last(self) -> list[float]:
        """`kv_usage()` after each step of the latest call but its last."""
        return []

    def abort(self, request: Request, reason: str) -> None:
        """Abort `request`, one it holds: its blocks are freed now and its next `step` returns it."""
        self._abort(request, reason)

    def abort_all(self, reason: str) -> list[Request]:
        """Abort every request it holds, with `reason`; returns them."""
        aborted = self._abort_all(reason)
        self._release(aborted)
        return aborted

    def _release(self, done: list[Request]) -> None:
        for request in done:
            self.outstanding_tokens -= self.held.pop(request, 0)
            if request.abort_reason is None:
                self.num_finished += 1
            else:
                self.num_aborted += 1

    def _record(self, finished: list[Request]) -> None:
        self._release(finished)
        usage = self.kv_usage()
        self.num_steps += 1
        self.kv_usage_sum += usage
        self.kv_usage_max = max(self.kv_usage_max, usage)

    def kv_usage(self) -> float:
        """`load().kv_usage`: what each step records."""
        return self.load().kv_usage

    @abstractmethod
    def request_counts(self) -> tuple[int, int]:
        """Requests it holds running and waiting (`Engine.request_counts`)."""

    @abstractmethod
    def _submit(self, request: Request) -> None: ...

    @abstractmethod
    def _step(self) -> list[Request]: ...

    @abstractmethod
    def _abort(self, request: Request, reason: str) -> None: ...

    @abstractmethod
    def _abort_all(self, reason: str) -> list[Request]: ...

    # -- what the fleet's summary asks (paged.experiment.summary) ------------------------------------------

    @abstractmethod
    def kv_stats(self) -> KVStats: ...

    @property
    @abstractmethod
    def counters(self) -> SchedulerCounters: ...

    @property
    @abstractmethod
    def num_swap_fallbacks(self) -> int: ...

    @property
    @abstractmethod
    def executor(self) -> Executor:
        """The executor, or what stands for it in this process (a Ray replica's description)."""

    @property
    @abstractmethod
    def caches_prefixes(self) -> bool: ...

    @abstractmethod
    def plugin_classes(self) -> dict[str, str]: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Stop what the replica started outside this process; no-op by default."""

    def row(self) -> dict[str, Any]:
        """summary.json's per-replica row."""
        kv = self.kv_stats()
        hit_rate = kv.num_hit_tokens / kv.num_queried_tokens if self.caches_prefixes and kv.num_queried_tokens else None
        return {
            "replica": self.index,
            "alive": self.alive,
            "num_requests": self.num_routed,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_steps": self.num_steps,
            "prefix_cache_hit_rate": hit_rate,
            "kv_usage_mean": self.kv_usage_sum / self.num_steps if self.num_steps else 0.0,
            "kv_usage_max": self.kv_usage_max,
            "num_preemptions": self.counters.num_preemptions,
        }


class LocalReplica(Replica):
    """An engine in this process. An idle replica's clock catches up with an arrival before it
    takes the request (simulated time: the replicas of a fleet share one timeline)."""

    def __init__(self, index: int, engine: Engine) -> None:
        super().__init__(index, engine.block_size)
        self.engine = engine

    @property
    def clock(self) -> Clock:
        return self.engine.clock

    def _submit(self, request: Request) -> None:
        clock = self.engine.clock
        if clock.simulated and not self.engine.has_unfinished:
            clock.wait_until(request.arrival_time)
        self.engine.add_request(request)

    def _step(self) -> list[Request]:
        return self.engine.step()

    def _step_until(self, until: float) -> list[Request]:
        return self.engine.step(until)

    def hold_steps(self, held: HeldSteps) -> None:
        index = self.index

        def hold(start: float, step: tuple[Any, ...]) -> None:
            held.hold(start, index, step)

        self.engine.hold = hold
        ff = self.engine.fast_forward
        if isinstance(ff, FastForward):
            ff.hold = hold

    @property
    def can_lag(self) -> bool:
        return isinstance(self.engine.fast_forward, FastForward) and self.engine.clock.simulated

    def next_event(self) -> float:
        ff = self.engine.fast_forward
        return ff.horizon(self.engine) if isinstance(ff, FastForward) else self.engine.clock.now()

    def run_window_to(self, t: float) -> None:
        engine = self.engine
        if engine.clock.now() >= t or not engine.has_unfinished:
            return
        ff = engine.fast_forward
        if not isinstance(ff, FastForward) or not ff.step(engine, t) or engine.clock.now() < t:
            # `next_event` promised window steps up to its bound: a wrong bound would skew the run
            raise AssertionError(f"replica {self.index}: its window ended before {t}, inside its horizon")
        self._count_steps([])

    def _usages_before_last(self) -> list[float]:
        ff = self.engine.fast_forward
        if not isinstance(ff, FastForward) or not ff.free_blocks:
            return []
        # `Scheduler.kv_usage`'s arithmetic on each step's free blocks
        num_blocks = self.engine.scheduler.block_manager.allocator.num_blocks
        return [1.0 - free / num_blocks for free in ff.free_blocks]

    def _abort(self, request: Request, reason: str) -> None:
        self.engine.abort(request, reason)

    def _abort_all(self, reason: str) -> list[Request]:
        return self.engine.abort_all(reason)

    def kv_stats(self) -> KVStats:
        return self.engine.kv_stats()

    @property
    def counters(self) -> SchedulerCounters:
        return self.engine.counters

    @property
    def num_swap_fallbacks(self) -> int:
        return self.engine.num_swap_fallbacks

    @property
    def executor(self) -> Executor:
        return self.engine.executor

    @property
    def caches_prefixes(self) -> bool:
        return self.engine.caches_prefixes

    def plugin_classes(self) -> dict[str, str]:
        return self.engine.plugin_classes()

    def shutdown(self) -> None:
        self.engine.executor.shutdown()

    def load(self) -> ReplicaLoad:
        if self.reads_at is not None:
            self.run_window_to(self.reads_at)
        s = self.engine.scheduler
        return ReplicaLoad(
            outstanding_tokens=self.outstanding_tokens,
            num_requests=len(self.held),
            num_waiting=len(s.waiting),
            kv_usage=self.kv_usage(),
        )

    def request_counts(self) -> tuple[int, int]:
        return self.engine.request_counts()

    def kv_usage(self) -> float:
        # asked after every step: read off the allocator without building the whole load
        return self.engine.kv_usage()

    def cached_prefix_blocks(self, chain: list[bytes]) -> int:
        engine, t = self.engine, self.reads_at
        matched = engine.cached_prefix_blocks(chain)
        if t is None or engine.clock.now() >= t:
            return matched
        ff = engine.fast_forward
        if isinstance(ff, FastForward) and ff.prefix_unchanged(engine, chain, matched):
            return matched  # what the steps before `t` would leave it at
        self.run_window_to(t)
        return engine.cached_prefix_blocks(chain)
