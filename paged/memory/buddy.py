"""A buddy allocator over block ids: the contiguous allocation of the PagedAttention paper's Orca
baselines.

Every allocation is one extent of consecutive block ids, rounded up to a power of two as a buddy
system does; the ids past the request (`num_unassigned_blocks`) belong to no sequence and count as
external fragmentation, as do free chunks too small for the next request
(`num_stranded_free_blocks`). A freed extent merges with its buddy while the buddy is free too, so
free memory splinters only as far as live extents pin it. Paired with a reservation
(`paged.memory.reservation`), a sequence gets its whole reservation as one extent at admission and
the unchanged kernels read it through an ordinary block table.
"""

from __future__ import annotations

from typing import ClassVar

from paged.memory.allocator import NoFreeBlocksError, RefCountedAllocator


def order_of(num_blocks: int) -> int:
    """The buddy order (log2 of the chunk size) that holds `num_blocks` blocks."""
    return max(num_blocks - 1, 0).bit_length()


class BuddyAllocator(RefCountedAllocator):
    contiguous: ClassVar[bool] = True

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        # A pool that is not a power of two is a row of power-of-two roots, largest first; each
        # root starts at a multiple of its size, so a chunk's buddy is `start ^ size` inside it.
        self._root_order = [0] * num_blocks
        self._free: list[set[int]] = [set() for _ in range(num_blocks.bit_length())]
        start = 0
        for order in reversed(range(num_blocks.bit_length())):
            if num_blocks - start >= 1 << order:
                self._root_order[start : start + (1 << order)] = [order] * (1 << order)
                self._free[order].add(start)
                start += 1 << order
        self._num_free = num_blocks
        self._extent_of = [-1] * num_blocks  # block -> the start of its extent, while allocated
        self._extent_order: dict[int, int] = {}
        self._extent_live: dict[int, int] = {}  # extent start -> its blocks still referenced
        self._num_unassigned = 0

    # -- extents ---------------------------------------------------------------------------------

    def allocate(self) -> int:
        return self.allocate_blocks(1)[0]

    def allocate_blocks(self, num_blocks: int) -> list[int]:
        order = order_of(num_blocks)
        source = next((o for o in range(order, len(self._free)) if self._free[o]), None)
        if num_blocks <= 0 or source is None:
            raise NoFreeBlocksError(
                f"no free extent of {1 << order} contiguous blocks for {num_blocks} blocks "
                f"({self._num_free} of {self.num_blocks} blocks are free, in smaller pieces)"
            )
        # lowest address first keeps allocation deterministic and packs live extents low
        start = min(self._free[source])
        self._free[source].remove(start)
        while source > order:  # split, keeping the upper halves free
            source -= 1
            self._free[source].add(start + (1 << source))
        self._num_free -= 1 << order
        self._num_unassigned += (1 << order) - num_blocks
        self._extent_order[start] = order
        self._extent_live[start] = num_blocks
        for block_id in range(start, start + num_blocks):
            self._extent_of[block_id] = start
            self._refcounts[block_id] = 1
        return list(range(start, start + num_blocks))

    def _release(self, block_id: int) -> None:
        start = self._extent_of[block_id]
        self._extent_of[block_id] = -1
        self._extent_live[start] -= 1
        self._num_unassigned += 1
        if self._extent_live[start]:
            return  # an extent returns whole: Orca frees a request's reservation when it finishes
        del self._extent_live[start]
        order = self._extent_order.pop(start)
        self._num_unassigned -= 1 << order
        self._num_free += 1 << order
        while order < self._root_order[start] and (buddy := start ^ (1 << order)) in self._free[order]:
            self._free[order].remove(buddy)
            start = min(start, buddy)
            order += 1
        self._free[order].add(start)

    # -- accounting ------------------------------------------------------------------------------

    def can_allocate_blocks(self, num_blocks: int) -> bool:
        if num_blocks <= 0:
            return True
        order = order_of(num_blocks)
        return any(self._free[o] for o in range(order, len(self._free)))

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def max_allocation(self) -> int:
        return 1 << (self.num_blocks.bit_length() - 1)

    @property
    def num_unassigned_blocks(self) -> int:
        return self._num_unassigned

    def num_stranded_free_blocks(self, num_blocks: int) -> int:
        order = order_of(num_blocks)
        return sum(len(chunks) << o for o, chunks in enumerate(self._free[:order]))
