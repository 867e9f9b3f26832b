"""`router=session`: every request of a client to the replica its first one went to (sticky
sessions, so a conversation keeps hitting its own prefix cache); a new client, or one without a
`client_id`, goes to the replica with the fewest outstanding tokens. A client whose replica died
is placed again."""

from __future__ import annotations

from collections.abc import Sequence

from paged.cluster.replica import ReplicaView
from paged.cluster.router import Router
from paged.request import Request


class SessionRouter(Router):
    def __init__(self) -> None:
        self._home: dict[str, int] = {}  # client id -> replica index

    def route(self, request: Request, replicas: Sequence[ReplicaView]) -> ReplicaView:
        by_index = {r.index: r for r in replicas}
        home = self._home.get(request.client_id) if request.client_id is not None else None
        if home is not None and home in by_index:
            return by_index[home]
        replica = min(replicas, key=lambda r: r.load_metric("outstanding_tokens"))
        if request.client_id is not None:
            self._home[request.client_id] = replica.index
        return replica

    def forget(self, replica: ReplicaView) -> None:
        self._home = {client: i for client, i in self._home.items() if i != replica.index}
