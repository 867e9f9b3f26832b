"""Least frequently used first: a block reused often stays, however long ago it was released."""

from __future__ import annotations

from paged.memory.eviction.keyed_heap import KeyedHeapPolicy


class LFUPolicy(KeyedHeapPolicy):
    """Evicts the evictable block with the fewest uses (its publish counts one, every prefix hit
    one more); ties go to the deeper block, then the one released longest ago (LRU). The count is
    forgotten with the block (no ghost), and never decays.

    insert, hit (in use), acquire, remove: O(1); release, hit (evictable), evict: O(log n) amortized.
    Chain order: a lookup walks a chain from its head and a head is published before its tail, so a
    head's count is at least its tail's; equal counts evict the deeper block, and a victim gives way
    to the deepest block of its release burst.
    """

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._count: dict[int, int] = {}

    def _score(self, block_id: int) -> float:
        return self._count[block_id]

    def _inserted(self, block_id: int) -> None:
        self._count[block_id] = 1

    def _hit(self, block_id: int) -> None:
        self._count[block_id] += 1

    def _forgotten(self, block_id: int) -> None:
        self._count.pop(block_id, None)
