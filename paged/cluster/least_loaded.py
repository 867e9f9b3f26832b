"""`router=least-loaded`: the replica with the least of one load metric (ties: the lowest index),
Vidur's least-outstanding-requests and vLLM's router's least-load policy."""

from __future__ import annotations

from collections.abc import Sequence

from paged.cluster.replica import LOAD_METRICS, ReplicaView
from paged.cluster.router import Router
from paged.request import Request


class LeastLoadedRouter(Router):
    def __init__(self, metric: str = "outstanding_tokens") -> None:
        """`metric`: one of `LOAD_METRICS`, which every replica reports."""
        if metric not in LOAD_METRICS:
            raise ValueError(
                f"metric={metric!r} is not a load replicas report; allowed: {', '.join(LOAD_METRICS)}"
            )
        self.metric = metric

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> ReplicaView:
        return min(replicas, key=lambda r: r.load_metric(self.metric))
