"""Disaggregated prefill and decode (DistServe, Splitwise, Mooncake) on the simulator's one timeline.

`cluster.prefill_replicas` engines compute prompts and `cluster.decode_replicas` engines decode,
each pool behind its own instance of the configured router. A request goes to a prefill replica,
which stops it at its first token (`pools.PrefillReplica`). At that time the decode router picks a
decode replica, where the request waits until the block manager can hold its prompt and first token
(`pools.DecodeReplica.reserve`: the watermark and `max_num_seqs` hold there as for any admission).
Then its prompt's KV blocks (the decode replica's block size, `kv_cache_spec(block_size)` bytes
each) are copied over the link between the two (`kv_link`: NVLink within a node, the network
across), after the copies before it out of the same prefill replica. When the last byte lands the
prefill replica frees its blocks and the decode replica runs the request from its first token,
which reaches the client then: TTFT counts the prefill, the wait for decode memory and the copy;
TPOT only decoding. Each copy is a `metrics.TransferRecord` (the summary's `kv_transfer_*` keys,
the request's `kv_transfer_s`).

Events in time order: the fleet steps the replica with the earliest clock among those with work,
unless a hand-off or a copy's arrival comes first; those happen between steps.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from paged.cluster.fleet import Fleet, FleetClock
from paged.cluster.kv_link import Placement
from paged.cluster.pools import DecodeReplica, PrefillReplica
from paged.cluster.router import Router
from paged.config import ConfigError
from paged.config.plugins import Plugin
from paged.engine.builder import build_engine
from paged.engine.metrics import MetricsRecorder, TransferRecord
from paged.request import Request

log = logging.getLogger(__name__)

# the abort reason of a request with more than one sequence: a hand-off moves one block table
ONE_SEQUENCE = "disaggregated prefill/decode serves one sequence per request (n = best_of = 1, no beam search)"


@dataclass(order=True)
class _Event:
    time: float
    order: int  # ties go in the order the events arose
    request: Request = field(compare=False)
    decode: DecodeReplica | None = field(compare=False, default=None)  # None: a hand-off, not yet routed
    record: TransferRecord | None = field(compare=False, default=None)


class PoolsClock(FleetClock):
    """`FleetClock` whose reset also frees every link."""

    def __init__(self, fleet: DisaggregatedFleet) -> None:
        super().__init__(fleet, simulated=True)
        self.pools = fleet

    def reset(self) -> None:
        """Also every link free from time 0."""
        super().reset()
        self.pools.free_links()


class DisaggregatedFleet(Fleet):
    """Public state besides `Fleet`'s: `prefill` and `decode` (the pools), `decode_router`,
    `placement` (nodes and links)."""

    def __init__(
        self, prefill: list[PrefillReplica], decode: list[DecodeReplica], router: Router, decode_router: Router,
        placement: Placement, metrics: MetricsRecorder | None = None,
    ) -> None:
        if not prefill or not decode:
            raise ValueError("a disaggregated fleet needs a prefill and a decode replica at least")
        super().__init__([*prefill, *decode], router, metrics)
        self.prefill = prefill
        self.decode = decode
        self.decode_router = decode_router
        self.placement = placement
        self.clock = PoolsClock(self)
        self._events: list[_Event] = []
        self._order = itertools.count()
        self._handed: dict[Request, tuple[PrefillReplica, float]] = {}  # -> its prefill replica, hand-off time
        self._link_free: dict[int, float] = {}  # prefill replica index -> when its link is free

    @property
    def has_unfinished(self) -> bool:
        return bool(self._events) or any(r.has_unfinished for r in self.live)

    def next_step_time(self) -> float | None:
        """The next event's time: the earliest clock among replicas with work, or an earlier
        hand-off or arrival; None when there is none."""
        times = [r.clock.now() for r in self.live if r.has_unfinished]
        if self._events:
            times.append(self._events[0].time)
        return min(times, default=None)

    def add_request(self, request: Request) -> None:
        if request.params.best_of > 1 and request.abort_reason is None:
            request.abort_reason = ONE_SEQUENCE  # the prefill replica's intake aborts it
        self.router.route(request, [r for r in self.prefill if r.alive]).add_request(request)

    def step(self, until: float | None = None, releases: bool = False) -> list[Request]:
        """The next event: a hand-off or an arrival when it comes first, else the earliest busy
        replica's step. Returns the requests it finished. `until` (the next arrival) and
        `releases` are not used: the replicas here step one iteration at a time."""
        busy = [r for r in self.live if r.has_unfinished]
        replica = min(busy, key=lambda r: r.clock.now()) if busy else None
        if self._events and (replica is None or self._events[0].time <= replica.clock.now()):
            self._handle(heapq.heappop(self._events))
            return []
        assert replica is not None  # has_unfinished: a busy replica or an event
        finished = replica.step()
        if isinstance(replica, PrefillReplica):
            t = replica.clock.now()
            for request in replica.take_handoffs():
                self._handed[request] = (replica, t)
                self._push(_Event(t, next(self._order), request))
        elif isinstance(replica, DecodeReplica):
            self._reserve(replica)  # its step may have freed blocks
        return finished

    def _push(self, event: _Event) -> None:
        heapq.heappush(self._events, event)

    def _handle(self, event: _Event) -> None:
        request = event.request
        if event.decode is None:  # handed off: to a decode replica, to wait for blocks there
            decode = self.decode_router.route(request, [r for r in self.decode if r.alive])
            assert isinstance(decode, DecodeReplica)
            decode.catch_up(event.time)
            decode.add_request(request)
            self._reserve(decode)
            return
        assert event.record is not None
        source, _ = self._handed.pop(request)
        source.release(request)
        event.decode.start_decode(request, event.time)
        # the first token reaches the client with its KV, from the decode side
        request.first_token_time = event.time
        request.token_times[0] = event.time
        request.kv_transfer_s = event.record.transfer_s
        self.metrics.on_transfer(event.record)

    def _reserve(self, decode: DecodeReplica) -> None:
        """Reserve blocks on `decode` for what waits there, and start each copy that got them."""
        reserved, refused = decode.reserve()
        for request in refused:
            self._handed.pop(request)[0].release(request)
        for request in reserved:
            self._start_transfer(request, decode)

    def _start_transfer(self, request: Request, decode: DecodeReplica) -> None:
        source, ready = self._handed[request]
        (seq,) = request.seqs
        # the prompt's KV; the first token's is computed by the decode replica's first step
        num_blocks = -(-seq.num_computed_tokens // decode.block_size)
        num_bytes = num_blocks * decode.executor.kv_cache_spec(decode.block_size).bytes_per_block
        link = self.placement.link(source.index, decode.index)
        start = max(decode.clock.now(), self._link_free.get(source.index, 0.0))
        end = start + link.seconds(num_bytes)
        self._link_free[source.index] = end
        record = TransferRecord(
            request.request_id, source.index, decode.index, link.name, num_blocks, num_bytes, ready, start, end
        )
        self._push(_Event(end, next(self._order), request, decode, record))

    def abort(self, request: Request, reason: str) -> None:
        raise NotImplementedError(
            "a disaggregated fleet aborts only all its requests: one may be between pools (its KV in transfer)"
        )

    def abort_all(self, reason: str) -> list[Request]:
        """Every request anywhere: queued, computing, handed off, waiting for decode blocks or for
        its KV. A request not yet routed to a decode replica is aborted on its prefill replica
        (which frees its blocks); one routed there is aborted by that replica, its prefill blocks
        freed here."""
        aborted = []
        for event in self._events:
            if event.decode is None:
                source, _ = self._handed.pop(event.request)
                source.engine.abort(event.request, reason)
                aborted.append(event.request)
        self._events.clear()
        for request, (source, _) in self._handed.items():
            source.release(request)
        self._handed.clear()
        return aborted + super().abort_all(reason)

    def free_links(self) -> None:
        self._link_free.clear()


def check_disaggregation(cfg: Any) -> Placement:
    """What disaggregation needs beyond a fleet: one sequence per request, and the links its pairs use."""
    w = cfg.workload
    if w.n > 1 or (w.best_of or 1) > 1 or w.use_beam_search:
        raise ConfigError(
            f"workload.n={w.n}, best_of={w.best_of}, use_beam_search={w.use_beam_search}: {ONE_SEQUENCE}"
        )
    c = cfg.cluster
    return Placement(cfg.hardware, c.prefill_replicas, c.decode_replicas)


def build_disaggregated_fleet(cfg: Any, router: Plugin) -> DisaggregatedFleet:
    """`cluster.prefill_replicas` and `cluster.decode_replicas` engines from `cfg`, each pool behind
    its own `router`, recording into one `MetricsRecorder`."""
    placement = check_disaggregation(cfg)
    metrics = MetricsRecorder()
    c = cfg.cluster
    engines = []
    for _ in range(c.prefill_replicas + c.decode_replicas):
        engine = build_engine(cfg)
        engine.metrics = metrics
        # KV lands on a decode replica whenever a link delivers it: no window is free of events
        # the fleet's heap does not show, so these engines step one iteration at a time
        engine.fast_forward = None
        engines.append(engine)
    prefill = [PrefillReplica(i, e) for i, e in enumerate(engines[: c.prefill_replicas])]
    decode = [DecodeReplica(c.prefill_replicas + i, e) for i, e in enumerate(engines[c.prefill_replicas :])]
    log.info(
        "disaggregated fleet: %d prefill + %d decode replicas on nodes %s, links %s, router %s",
        len(prefill), len(decode), placement.node, sorted(placement.links), cfg.router.name,
    )
    return DisaggregatedFleet(prefill, decode, router.build(), router.build(), placement, metrics)
