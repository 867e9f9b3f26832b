"""Prefix-caching allocator: full blocks are content-addressed and outlive their last reference."""

from __future__ import annotations

from typing import ClassVar

from paged.memory.allocator import NoFreeBlocksError, RefCountedAllocator
from paged.memory.free_queue import FreeBlockQueue


class PrefixCachingAllocator(RefCountedAllocator):
    """vLLM V1's BlockPool without the request bookkeeping.

    A block whose refcount reaches zero keeps its hash and waits in the free queue, so a later
    request with the same prefix can revive it; it is only evicted (lazily, when `allocate` pops
    it) in least-recently-freed order. Hashless blocks go to the front of the queue so they are
    reused before any cached block (vLLM PR #42656).
    """

    caches_prefixes: ClassVar[bool] = True

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._queue = FreeBlockQueue(num_blocks)
        self._hashes: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._num_cached_free = 0
        self.num_evictions = 0

    def allocate(self) -> int:
        if not self._queue:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        block_id = self._queue.popleft()
        block_hash = self._hashes[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hashes[block_id] = None
            self._num_cached_free -= 1
            self.num_evictions += 1
        self._refcounts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        if self._hashes[block_id] is None:
            self._queue.appendleft(block_id)
        else:
            self._queue.append(block_id)
            self._num_cached_free += 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._queue)

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    def match(self, block_hash: bytes) -> int | None:
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        if self._refcounts[block_id] == 0:
            self._queue.remove(block_id)
            self._num_cached_free -= 1
        self._refcounts[block_id] += 1
        return block_id

    def peek(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def insert(self, block_id: int, block_hash: bytes) -> None:
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

    def reset_prefix_cache(self) -> bool:
        if len(self._queue) != self.num_blocks:
            return False
        self._cached.clear()
        self._hashes = [None] * self.num_blocks
        self._num_cached_free = 0
        return True
