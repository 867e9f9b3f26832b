"""The busy replicas of a simulated fleet, by the time each must step next: a heap whose entries
can be moved (a lagging replica's key falls to its clock when a request reaches it), the moved
entry left behind and skipped when it surfaces."""

from __future__ import annotations

import heapq


class ReplicaQueue:
    """Replica indices by key (a time), ties to the lower index; one live entry per replica."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int]] = []  # (key, index, version): stale where the version moved on
        self._live: dict[int, int] = {}  # index -> the version of its live entry
        self._version = 0

    def __bool__(self) -> bool:
        return bool(self._live)

    def __contains__(self, index: int) -> bool:
        return index in self._live

    def indices(self) -> list[int]:
        return list(self._live)

    def push(self, index: int, key: float) -> None:
        """Queue `index` at `key`, replacing its entry if it has one."""
        self._version += 1
        self._live[index] = self._version
        heapq.heappush(self._heap, (key, index, self._version))

    def peek(self) -> float | None:
        """The smallest key; None when empty."""
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def pop(self) -> tuple[float, int]:
        """Remove and return the smallest (key, index)."""
        self._drop_stale()
        key, index, _ = heapq.heappop(self._heap)
        del self._live[index]
        return key, index

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def _drop_stale(self) -> None:
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][1]) != heap[0][2]:
            heapq.heappop(heap)
