"""The shared part of the policies that rank blocks by a number (LFU's count, FIFO's insertion
stamp, the cost policy's value): a min-heap of the evictable blocks with lazy deletion.

A block's key is fixed when it becomes evictable (or hit while evictable, which pushes a new key);
an acquired or evicted block's old entries stay in the heap until they surface and are skipped, and
the heap is rebuilt when stale entries outnumber live ones, so every operation stays O(log n)
amortized.
"""

from __future__ import annotations

import heapq
import itertools
from abc import abstractmethod

from paged.memory.allocator import NoFreeBlocksError
from paged.memory.eviction.eviction_policy import EvictionPolicy
from paged.memory.eviction.release_bursts import ReleaseBursts

# heap entry: (score, -position, release stamp, block id); the smallest is evicted first, so among
# equal scores the deepest block goes first, then the one released longest ago
_Entry = tuple[float, int, int, int]


class KeyedHeapPolicy(EvictionPolicy):
    """Evicts the evictable block of least `_score`; ties go to the deeper block, then the older
    release. Chain order: ties favour tails, and a victim is replaced by the deepest evictable block
    released in the same burst (`ReleaseBursts`)."""

    def __init__(self) -> None:
        self._position: dict[int, int] = {}  # every tracked block, in use or evictable
        self._entry: dict[int, _Entry] = {}  # evictable blocks -> their live heap entry
        self._heap: list[_Entry] = []
        self._stamps = itertools.count()
        self._bursts = ReleaseBursts()

    @abstractmethod
    def _score(self, block_id: int) -> float:
        """What keeping `block_id` is worth; the least is evicted first."""

    def _inserted(self, block_id: int) -> None:
        """A subclass's own bookkeeping for a newly published block."""
        return None

    def _hit(self, block_id: int) -> None:
        """A subclass's own bookkeeping for a hit."""
        return None

    def _forgotten(self, block_id: int) -> None:
        """A subclass drops what it keeps about `block_id`."""
        return None

    def insert(self, block_id: int, block_hash: bytes, position: int) -> None:
        self._bursts.interrupt()
        self._position[block_id] = position
        self._inserted(block_id)

    def hit(self, block_id: int) -> None:
        self._bursts.interrupt()
        self._hit(block_id)
        if block_id in self._entry:
            self._push(block_id)

    def release(self, block_id: int) -> None:
        assert block_id not in self._entry, f"block {block_id} is already evictable"
        self._push(block_id)
        self._bursts.released(block_id, self._position[block_id])

    def acquire(self, block_id: int) -> None:
        del self._entry[block_id]
        self._bursts.forget(block_id)

    def evict(self) -> int:
        if not self._entry:
            raise NoFreeBlocksError("no evictable block")
        heap = self._heap
        while self._entry.get(heap[0][3]) is not heap[0]:
            heapq.heappop(heap)
        victim = self._bursts.deepest(heap[0][3])
        self.remove(victim)
        return victim

    def remove(self, block_id: int) -> None:
        self._entry.pop(block_id, None)
        self._bursts.forget(block_id)
        self._position.pop(block_id, None)
        self._forgotten(block_id)

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._entry

    def _push(self, block_id: int) -> None:
        entry = (self._score(block_id), -self._position[block_id], next(self._stamps), block_id)
        self._entry[block_id] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._entry) + 64:
            self._heap = list(self._entry.values())
            heapq.heapify(self._heap)
