"""First in, first out: blocks leave in the order they entered the cache, whatever their reuse."""

from __future__ import annotations

import itertools

from paged.memory.eviction.keyed_heap import KeyedHeapPolicy


class FIFOPolicy(KeyedHeapPolicy):
    """Evicts the evictable block published longest ago; hits and releases never move a block
    (unlike LRU, which re-queues a block at each release).

    insert, hit, acquire, remove: O(1); release, evict: O(log n) amortized (a released block
    re-enters the evictable set at its insertion rank, not at the back).
    Chain order: a head is published before its tail, so insertion order alone would cut chains
    from the head; a victim gives way to the deepest block of its release burst instead, so a chain
    goes tail first once its oldest block is due (SGLang's FIFO over radix-tree leaves).
    """

    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._inserted_at: dict[int, int] = {}
        self._clock = itertools.count()

    def _score(self, block_id: int) -> float:
        return self._inserted_at[block_id]

    def _inserted(self, block_id: int) -> None:
        self._inserted_at[block_id] = next(self._clock)

    def _forgotten(self, block_id: int) -> None:
        self._inserted_at.pop(block_id, None)
