"""The two kinds of replica of a disaggregated fleet (`paged.cluster.disaggregated`).

A `PrefillReplica` computes prompts: a request leaves it at its first token (unless that token ends
it) with its KV still in its cache until the fleet has copied it out (`release`). A `DecodeReplica`
takes requests whose prompt was computed elsewhere: each waits in `incoming`, in arrival order,
until its block manager can hold the prompt and first token above the watermark (`reserve`); it
keeps those blocks while the KV arrives, then decodes it (`start_decode`). A decode replica has
work to step only for what it decodes: a request waiting for blocks or KV has nothing to compute.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from paged.cluster.replica import LocalReplica, ReplicaLoad
from paged.engine.engine import Engine
from paged.memory import AllocStatus
from paged.request import Request
from paged.scheduler.rejection import allocation_rejection

PREFILL = "prefill"
DECODE = "decode"


class PrefillReplica(LocalReplica):
    """Its `num_finished` counts the requests it computed the prompt of and handed on."""

    pool = PREFILL

    def __init__(self, index: int, engine: Engine) -> None:
        super().__init__(index, engine)
        engine.scheduler.hands_off = True
        self.handoffs: list[Request] = []

    def step(self) -> list[Request]:
        """One step; returns what it finished outright (aborted, or ended by the first token). A
        request handed off leaves its load too, and waits in `handoffs`."""
        finished = self.engine.step()
        handed = self.engine.scheduler.take_handoffs()
        self._record(finished + handed)
        self.handoffs.extend(handed)
        return finished

    def take_handoffs(self) -> list[Request]:
        handed, self.handoffs = self.handoffs, []
        return handed

    def release(self, request: Request) -> None:
        """`request`'s KV has left (or it was aborted on its way): free its blocks here."""
        self.engine.scheduler.release(request)

    def row(self) -> dict[str, Any]:
        return super().row() | {"pool": self.pool}


class DecodeReplica(LocalReplica):
    pool = DECODE

    def __init__(self, index: int, engine: Engine) -> None:
        super().__init__(index, engine)
        self.incoming: deque[Request] = deque()

    @property
    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished

    def catch_up(self, t: float) -> None:
        """An idle replica's clock moves to `t`, when something reaches it."""
        if not self.engine.has_unfinished:
            self.clock.wait_until(t)

    def _submit(self, request: Request) -> None:
        self.incoming.append(request)

    def reserve(self) -> tuple[list[Request], list[Request]]:
        """Blocks for the incoming requests, in arrival order, while the cache holds them. Returns
        those reserved and those refused: aborted with the reason, as this replica can never hold
        them (the cache is too small, or it is already empty and still short)."""
        s = self.engine.scheduler
        reserved: list[Request] = []
        refused: list[Request] = []
        while self.incoming:
            request = self.incoming[0]
            status = s.reserve(request)
            if status is not AllocStatus.OK:
                idle = not (self.engine.has_unfinished or s.receiving)
                reason = allocation_rejection(s.block_manager, request.seqs, status, idle=idle)
                if reason is None:
                    break  # it waits for blocks that requests decoding here will free
                self.engine.abort(request, reason)
                refused.append(request)
            else:
                reserved.append(request)
            self.incoming.popleft()
        return reserved, refused

    def start_decode(self, request: Request, t: float) -> None:
        """`request`'s KV arrived at `t`: it joins the running requests (at this replica's next step)."""
        self.catch_up(t)
        self.engine.scheduler.start_decode(request, self.clock.now())

    def _abort_all(self, reason: str) -> list[Request]:
        """Also the requests waiting for blocks or for their KV (the fleet frees their prefill side)."""
        s = self.engine.scheduler
        in_flight = [*self.incoming, *(seq.request for seq in s.receiving)]
        self.incoming.clear()
        for request in in_flight:
            self.engine.abort(request, reason)
        return in_flight + self.engine.abort_all(reason)

    def request_counts(self) -> tuple[int, int]:
        """Requests waiting for blocks here count as waiting."""
        running, waiting = super().request_counts()
        return running, waiting + len(self.incoming)

    def load(self) -> ReplicaLoad:
        """Requests waiting for blocks here count as waiting."""
        load = super().load()
        return ReplicaLoad(load.outstanding_tokens, load.num_requests, load.num_waiting + len(self.incoming),
                           load.kv_usage)

    def row(self) -> dict[str, Any]:
        return super().row() | {"pool": self.pool}
