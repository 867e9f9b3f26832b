"""Free-list allocator without prefix caching: the PagedAttention paper's baseline."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator

from paged.memory.allocator import NoFreeBlocksError, RefCountedAllocator


class NaiveAllocator(RefCountedAllocator):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        # The free list is the freed blocks, then every block from `_never_used` on, in id order: the
        # order of a deque of all ids, without one Python int per block up front (a swap pool of
        # 4 GiB of small blocks is tens of millions of them: seconds and GBs to build).
        self._free: deque[int] = deque()
        self._never_used = 0

    def allocate(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        elif self._never_used < self.num_blocks:
            block_id = self._never_used
            self._never_used += 1
        else:
            raise NoFreeBlocksError(f"all {self.num_blocks} blocks are in use")
        self._refcounts[block_id] = 1
        return block_id

    def _release(self, block_id: int) -> None:
        # LIFO reuse, as vLLM's NaiveBlockAllocator: a just-freed block is likely still in cache.
        self._free.appendleft(block_id)

    def free_ids(self) -> Iterator[int]:
        """The free blocks, in the order `allocate` hands them out."""
        return itertools.chain(self._free, range(self._never_used, self.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self._never_used
