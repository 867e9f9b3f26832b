"""Least recently released first: vLLM V1's free-block queue order, the default policy."""

from __future__ import annotations

from collections import OrderedDict

from paged.memory.allocator import NoFreeBlocksError
from paged.memory.eviction.eviction_policy import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the block whose last reference was dropped longest ago; inserts and hits do not
    reorder (a reused block is in use, and re-enters at the back when released again), which is
    exactly where vLLM's FreeKVCacheBlockQueue appends a freed cached block.

    Every operation O(1) (an OrderedDict in release order).
    Chain order: every holder of a tail also holds its head and frees its table last block first,
    so a tail's last release comes before its head's: release order already evicts tails first.
    """

    name = "lru"

    def __init__(self) -> None:
        self._evictable: OrderedDict[int, None] = OrderedDict()

    def insert(self, block_id: int, block_hash: bytes, position: int) -> None:
        return None

    def hit(self, block_id: int) -> None:
        return None

    def release(self, block_id: int) -> None:
        assert block_id not in self._evictable, f"block {block_id} is already evictable"
        self._evictable[block_id] = None

    def acquire(self, block_id: int) -> None:
        del self._evictable[block_id]

    def evict(self) -> int:
        if not self._evictable:
            raise NoFreeBlocksError("no evictable block")
        return self._evictable.popitem(last=False)[0]

    def remove(self, block_id: int) -> None:
        self._evictable.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._evictable)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._evictable
