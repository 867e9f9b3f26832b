"""`router=round-robin`: each request to the next replica in turn (Vidur's default), blind to load."""

from __future__ import annotations

from collections.abc import Sequence

from paged.cluster.replica import ReplicaView
from paged.cluster.router import Router
from paged.request import Request


class RoundRobinRouter(Router):
    def __init__(self) -> None:
        self._next = 0

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> ReplicaView:
        replica = replicas[self._next % len(replicas)]
        self._next += 1
        return replica
