"""Virtual Token Counter (VTC) fair sharing between clients (Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024, Algorithm 2).

Why: FCFS lets a client that sends many or long requests take the whole batch, so a light client's
latency depends on the heaviest one. VTC keeps one counter per client of the weighted service it
has received, `input_weight` per prefill token plus `output_weight` per decoded token (the paper's
w_p = 1, w_q = 2, a decode token costing more than a prefill one), and admits from the client with
the smallest counter, ties by arrival. As in the paper, where admitting a request adds its prompt to
the counter at once, one ordering interleaves clients: each sequence placed adds its pending service
to its client's counter before the next one is chosen, so one client's backlog does not fill a step.

Counter lift: a client that comes back after having nothing queued or running must not cash in the
service it did not use while away, so its counter is raised to the smallest counter among the
clients that do have requests queued or running (the paper's Q holds waiting requests only; a
client whose requests all run is counted here too); when none has, to the counter of the client
that left last (the paper's rule for an empty queue). Counters otherwise persist across idle time.

Preemption takes from the client with the largest counter, its newest sequence first. Requests
without a client id all count as one client, `default`; a warning says so once, since fair sharing
then sees a single client and orders like FCFS.

Service is counted when the scheduler hands a step to the executor: a decode row (`is_decode`) is
output service, any other row prefill service (a prompt chunk, or a recompute after preemption).
The token a prefill step samples is not counted as output.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter, deque
from typing import TYPE_CHECKING

from paged.request import Request, Sequence
from paged.scheduler.policy import SchedulingPolicy

if TYPE_CHECKING:
    from paged.step import SchedulerOutput

log = logging.getLogger(__name__)

DEFAULT_CLIENT = "default"


class VTCPolicy(SchedulingPolicy):
    step_invariant = False  # on_scheduled counts every step's service
    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0) -> None:
        for name, value in (("input_weight", input_weight), ("output_weight", output_weight)):
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0 (service counted per token), got {value!r}")
        if input_weight == output_weight == 0:
            raise ValueError("input_weight and output_weight must not both be 0: no service would be counted")
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: dict[str, float] = {}
        # requests queued or running, per client; a client is active while it has one
        self.active: Counter[str] = Counter()
        self._client_of: dict[Request, str] = {}
        self._last_left = 0.0  # counter of the client that most recently stopped being active
        self._warned = False

    @staticmethod
    def client(request: Request) -> str:
        return DEFAULT_CLIENT if request.client_id is None else request.client_id

    def counter(self, request: Request) -> float:
        return self.counters.get(self.client(request), 0.0)

    def service(self, num_new_tokens: int, is_decode: bool) -> float:
        """Weighted service of a step's row: a decode, or `num_new_tokens` of prefill."""
        return self.output_weight if is_decode else self.input_weight * num_new_tokens

    def admission_key(self, seq: Sequence, now: float) -> tuple[float, float, int]:
        return (self.counter(seq.request), seq.request.arrival_time, seq.seq_id)

    def victim_key(self, seq: Sequence, now: float) -> tuple[float, float, int]:
        # the same key: the largest counter loses first, and within it the newest sequence
        return self.admission_key(seq, now)

    def order(self, seqs: list[Sequence], now: float) -> list[Sequence]:
        queues: dict[str, deque[Sequence]] = {}
        for seq in sorted(seqs, key=lambda s: (s.request.arrival_time, s.seq_id)):
            queues.setdefault(self.client(seq.request), deque()).append(seq)
        heap = [(*self.admission_key(q[0], now), client) for client, q in queues.items()]
        heapq.heapify(heap)
        ordered = []
        while heap:
            projected, _, _, client = heapq.heappop(heap)
            queue = queues[client]
            seq = queue.popleft()
            ordered.append(seq)
            if queue:
                pending = seq.num_tokens - seq.num_computed_tokens
                projected += self.service(pending, pending == 1 and seq.num_output_tokens > 0)
                head = queue[0]
                heapq.heappush(heap, (projected, head.request.arrival_time, head.seq_id, client))
        return ordered

    def on_add(self, request: Request, now: float) -> None:
        if request in self._client_of:  # re-queued after preemption: still the same active request
            return
        if request.client_id is None and not self._warned:
            self._warned = True
            log.warning(
                "fair scheduling (VTC): request %r names no client; all such requests count as one client %r, "
                "so fair sharing sees one client. Set workload.num_clients, or a `client` field per prompt",
                request.request_id, DEFAULT_CLIENT,
            )
        client = self.client(request)
        if not self.active[client]:
            active = [self.counters.get(c, 0.0) for c in self.active]
            floor = min(active) if active else self._last_left
            self.counters[client] = max(self.counters.get(client, 0.0), floor)
        self.active[client] += 1
        self._client_of[request] = client

    def on_scheduled(self, out: SchedulerOutput, now: float) -> None:
        for row in out.scheduled:
            client = self.client(row.seq.request)
            self.counters[client] = self.counters.get(client, 0.0) + self.service(row.num_new_tokens, row.is_decode)

    def on_finished(self, request: Request, now: float) -> None:
        client = self._client_of.pop(request, None)
        if client is None:  # never queued here, or already reported
            return
        self.active[client] -= 1
        if not self.active[client]:
            del self.active[client]
            self._last_left = self.counters.get(client, 0.0)
