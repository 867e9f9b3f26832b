"""The router seam: which replica gets a request.

A router is a plugin of the `router` config group, built as `cls(**its settings)`; `route` sees
the request and every live replica through `ReplicaView` only (its load and prefix cache), so one
router runs unchanged over simulated replicas, engines in this process and Ray actors.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from paged.cluster.replica import ReplicaView
from paged.request import Request


class Router(ABC):
    @abstractmethod
    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> ReplicaView:
        """The replica of `request`, one of `replicas` (the live ones, never empty)."""

    def forget(self, replica: ReplicaView) -> None:  # noqa: B027 - optional hook
        """`replica` died: drop whatever the router keeps about it; no-op by default."""
