"""A replica whose engine is a Ray actor (`paged.cluster.engine_actor`), as the driver holds it.

The driver keeps the `Request` objects (the runner, the metrics and the outputs read them); the actor
works on its own copies and returns, per step, a `StepReport`. This proxy applies it: the outcomes
of the requests that ended onto the driver's requests, the others' new tokens onto theirs (so a
server streams them as they come), the new step records into the fleet's
`MetricsRecorder` (numbered across the fleet, and shown to its step listeners), and the replica's
state (KV usage, queue, counters) for the router and the summary, one step old at most.

A step runs in the background: `launch` sends it, `step` collects its report, so the fleet can keep
one step in flight per replica (`paged.cluster.ray_fleet.RayFleet.step`). An abort of one request
(`Fleet.abort`: a server's client left) is sent without waiting; the actor runs it after the step
in flight, and the step after reports the request ended.

`cached_prefix_blocks` answers 0: asking the actor what its prefix cache holds would cost a round
trip per routed request. The prefix-aware router counts the prompts it sent each replica as held,
so it still routes a shared prefix to the replica that has it; blocks the replica evicted since go
unnoticed.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from paged.cluster.replica import Replica, ReplicaLoad
from paged.cluster.replica_messages import ReplicaInfo, StepReport, Submission
from paged.engine.metrics import MetricsRecorder
from paged.executor.base import KVCacheSpec
from paged.request import Request, Sequence
from paged.scheduler.core import SchedulerCounters
from paged.step import KVStats
from paged.utils.clock import WallClock


class ReplicaClock(WallClock):
    """The driver's wall clock; a reset also moves the actor's origin to the same moment (sent as
    epoch seconds, so it holds across machines to their clock sync). Nothing waits for the actor:
    its calls run in the order sent, so the reset lands before any request sent after it."""

    def __init__(self, actor: Any) -> None:
        super().__init__()
        self._actor = actor

    def reset(self) -> None:
        super().reset()
        self._actor.reset_clock.remote(time.time())


class ExecutorView:
    """What the driver asks of a remote replica's executor (the summary's description, the workload's
    tokenizer and vocabulary), from the `ReplicaInfo` asked once, and its decode-step counts as of the
    replica's last step."""

    def __init__(self, info: ReplicaInfo) -> None:
        self.description = info.description
        self.kernel_description = info.kernel_description
        self.threads = info.threads
        self.num_devices = info.num_devices
        self.tokenizer = info.tokenizer
        self.vocab_size = info.vocab_size
        self.eos_token_ids = info.eos_token_ids
        self._spec = info.kv_cache_spec
        self.kv_layout = info.kv_layout
        self.step_counts = info.state.decode_step_counts

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        if block_size != self._spec.block_size:
            raise ValueError(
                f"the replica's cache has blocks of {self._spec.block_size} tokens, not {block_size}"
            )
        return self._spec

    def decode_step_counts(self) -> dict[str, int | None]:
        return dict(self.step_counts)


class RayReplica(Replica):
    """A replica on a Ray actor. Besides `Replica`'s state: `actor` (its handle), `info`, `in_flight`
    (the step sent and not yet collected, or None), `num_rerouted` (requests moved off it when it
    died) and `died` (why it died, or None)."""

    def __init__(self, index: int, actor: Any, info: ReplicaInfo, metrics: MetricsRecorder) -> None:
        super().__init__(index, info.kv_cache_spec.block_size)
        self.actor = actor
        self.info = info
        self.metrics = metrics
        self.in_flight: ray.ObjectRef | None = None
        self.num_rerouted = 0
        self.died: str | None = None
        self._clock = ReplicaClock(actor)
        self._executor = ExecutorView(info)
        self._state: StepReport = info.state
        self._requests: dict[int, Request] = {}  # the driver's requests by the key sent with them
        self._keys: dict[Request, int] = {}  # the other way round
        self._next_key = 0

    @property
    def clock(self) -> ReplicaClock:
        return self._clock

    def _submit(self, request: Request) -> None:
        key, self._next_key = self._next_key, self._next_key + 1
        self._requests[key] = request
        self._keys[request] = key
        self.actor.add_request.remote(Submission.of(key, request))

    def launch(self) -> None:
        """Send a step unless one is in flight."""
        if self.in_flight is None:
            self.in_flight = self.actor.step.remote()

    def _step(self) -> list[Request]:
        """Collect the step in flight (sending one first if none is); raises `ray.exceptions.RayActorError`
        if the actor died."""
        self.launch()
        ref, self.in_flight = self.in_flight, None
        return self._absorb(ray.get(ref))

    def _abort(self, request: Request, reason: str) -> None:
        """Sent, not waited for: the actor runs it after the step in flight (a request that step
        ended is no longer there to abort), and the step after reports the request aborted."""
        self.actor.abort.remote(self._keys[request], reason)

    def _abort_all(self, reason: str) -> list[Request]:
        return self._absorb(ray.get(self.actor.abort_all.remote(reason)))

    def _absorb(self, report: StepReport) -> list[Request]:
        """Apply a report; returns the driver's requests that ended in it."""
        for record in report.steps:
            self.metrics.add_step(record)  # numbered in the driver's sequence
        service = self.metrics.client_service
        for client, total in report.client_service.items():
            service[client] = service.get(client, 0.0) + total - self._state.client_service.get(client, 0.0)
        self._state = report
        self._executor.step_counts = report.decode_step_counts
        for progress in report.progress:
            progress.apply(self._requests[progress.key])
        done = []
        for outcome in report.outcomes:
            request = self._requests.pop(outcome.key)
            del self._keys[request]
            outcome.apply(request)
            done.append(request)
        return done

    def lose(self, error: str) -> list[Request]:
        """The actor died: mark this replica dead and hand back the requests it held (the driver's,
        untouched by the actor: they start afresh wherever they go)."""
        self.alive = False
        self.died = error
        self.in_flight = None
        orphans = list(self.held)
        for request in orphans:  # the tokens the actor reported (`Progress`) go: it starts afresh
            request.seqs = [Sequence(request, list(request.prompt_token_ids))]
        self.held.clear()
        self._requests.clear()
        self._keys.clear()
        self.outstanding_tokens = 0
        return orphans

    # -- what the router and the summary ask: the state of the last report ----------------------

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(
            outstanding_tokens=self.outstanding_tokens,
            num_requests=len(self.held),
            num_waiting=self._state.num_waiting,
            kv_usage=self._state.kv_usage,
        )

    def request_counts(self) -> tuple[int, int]:
        """Running as of the last report; every other request it holds waits (those sent since too)."""
        running = min(self._state.num_running_requests, len(self.held))
        return running, len(self.held) - running

    def cached_prefix_blocks(self, chain: list[bytes]) -> int:
        return 0  # not asked of the actor: see the module's docstring

    def kv_stats(self) -> KVStats:
        return self._state.kv

    @property
    def counters(self) -> SchedulerCounters:
        return self._state.counters

    @property
    def num_swap_fallbacks(self) -> int:
        return self._state.num_swap_fallbacks

    @property
    def executor(self) -> ExecutorView:  # type: ignore[override]
        return self._executor

    @property
    def caches_prefixes(self) -> bool:
        return self.info.caches_prefixes

    def plugin_classes(self) -> dict[str, str]:
        return dict(self.info.plugin_classes)

    def row(self) -> dict[str, Any]:
        return super().row() | {"node": self.info.node, "num_rerouted": self.num_rerouted, "died": self.died}
