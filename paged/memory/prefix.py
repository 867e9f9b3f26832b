"""Prefix-caching allocator: full blocks are content-addressed and outlive their last reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from paged.memory.allocator import NoFreeBlocksError, RefCountedAllocator
from paged.memory.eviction import EvictionPolicy, LRUPolicy
from paged.memory.free_queue import FreeBlockQueue

# (block id, block hash) of a cached block being evicted
EvictHook = Callable[[int, bytes], None]


class PrefixCachingAllocator(RefCountedAllocator):
    """vLLM V1's BlockPool without the request bookkeeping, with the eviction order a seam.

    A block whose refcount reaches zero keeps its hash and becomes evictable, so a later request
    with the same prefix can revive it; it is only evicted (lazily, when `allocate` runs out of
    hashless blocks) when `eviction` picks it, least recently freed first by default (LRU). Hashless
    free blocks are reused before any cached block, the last freed first (vLLM PR #42656).

    `on_evict(block_id, block_hash)`, when set, is called as a cached block is evicted, before
    `allocate` hands it out again: its KV is still intact (a lower tier copies it out then), and
    `position(block_id)` still answers.
    """

    caches_prefixes: ClassVar[bool] = True

    def __init__(self, num_blocks: int, block_size: int, eviction: EvictionPolicy | None = None) -> None:
        super().__init__(num_blocks, block_size)
        self.eviction = eviction if eviction is not None else LRUPolicy()
        self.on_evict: EvictHook | None = None
        self._hashless = FreeBlockQueue(num_blocks)  # the front is reused first
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._positions = [0] * num_blocks
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    def allocate(self) -> int:
        if self._hashless:
            block_id = self._hashless.popleft()
        elif self.eviction:
            block_id = self.eviction.evict()
            block_hash = self._hashes[block_id]
            assert block_hash is not None and self._refcounts[block_id] == 0, f"evicted block {block_id} is not free"
            del self._cached[block_hash]
            self._hashes[block_id] = None
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(block_id, block_hash)
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        self._refcounts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        if self._hashes[block_id] is None:
            self._hashless.appendleft(block_id)
        else:
            self.eviction.release(block_id)

    @property
    def num_free_blocks(self) -> int:
        return len(self._hashless) + len(self.eviction)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.eviction)

    def match(self, block_hash: bytes) -> int | None:
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        if self._refcounts[block_id] == 0:
            self.eviction.acquire(block_id)
        self.eviction.hit(block_id)
        self._refcounts[block_id] += 1
        return block_id

    def peek(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def peeker(self) -> Callable[[bytes], int | None]:
        """`peek` as the cache map's own `get` (the map is never rebound): a chain's walk without a
        Python call per hash."""
        return self._cached.get

    def insert(self, block_id: int, block_hash: bytes, position: int = 0) -> None:
        assert self._refcounts[block_id] > 0, f"insert of free block {block_id}"
        current = self._hashes[block_id]
        if current is not None:
            assert current == block_hash, f"block {block_id} is already cached under another hash"
            return
        # A duplicate keeps the existing mapping: block tables stay append-only (no dedup), and
        # this block simply stays hashless.
        if block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self._hashes[block_id] = block_hash
            self._positions[block_id] = position
            self.eviction.insert(block_id, block_hash, position)

    def position(self, block_id: int) -> int:
        """The chain position `block_id` was last published at (0 when the caller gave none)."""
        return self._positions[block_id]

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False
        for block_id in self._cached.values():
            self.eviction.remove(block_id)
            self._hashless.append(block_id)
        self._cached.clear()
        self._hashes = [None] * self.num_blocks
        return True
