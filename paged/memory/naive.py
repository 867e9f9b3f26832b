"""Free-list allocator without prefix caching: the PagedAttention paper's baseline."""

from __future__ import annotations

from collections import deque

from paged.memory.allocator import NoFreeBlocksError, RefCountedAllocator


class NaiveAllocator(RefCountedAllocator):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self._free: deque[int] = deque(range(num_blocks))

    def allocate(self) -> int:
        if not self._free:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        block_id = self._free.popleft()
        self._refcounts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        # LIFO reuse, as vLLM's NaiveBlockAllocator: a just-freed block is likely still in cache.
        self._free.appendleft(block_id)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)
