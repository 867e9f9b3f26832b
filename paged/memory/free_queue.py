"""vLLM V1's FreeKVCacheBlockQueue: an intrusive doubly linked list of free block ids.

The links live in two int lists indexed by block id, so popleft, append, appendleft and removal
from the middle are O(1) and allocate no Python objects. The front is the next block to reuse.
"""

from __future__ import annotations

from collections.abc import Iterator

_DETACHED = -1


class FreeBlockQueue:
    def __init__(self, num_blocks: int) -> None:
        # Two sentinels past the last block id spare every operation its edge cases.
        self._head = num_blocks
        self._tail = num_blocks + 1
        self._next = [_DETACHED] * (num_blocks + 2)
        self._prev = [_DETACHED] * (num_blocks + 2)
        chain = [self._head, *range(num_blocks), self._tail]
        for a, b in zip(chain[:-1], chain[1:], strict=True):
            self._next[a] = b
            self._prev[b] = a
        self._len = num_blocks

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block_id: int) -> bool:
        return self._prev[block_id] != _DETACHED

    def __iter__(self) -> Iterator[int]:
        block_id = self._next[self._head]
        while block_id != self._tail:
            yield block_id
            block_id = self._next[block_id]

    def popleft(self) -> int:
        block_id = self._next[self._head]
        if block_id == self._tail:
            raise IndexError("popleft from an empty FreeBlockQueue")
        self.remove(block_id)
        return block_id

    def remove(self, block_id: int) -> None:
        prev, nxt = self._prev[block_id], self._next[block_id]
        assert prev != _DETACHED, f"block {block_id} is not in the free queue"
        self._next[prev] = nxt
        self._prev[nxt] = prev
        self._prev[block_id] = self._next[block_id] = _DETACHED
        self._len -= 1

    def append(self, block_id: int) -> None:
        self._link(block_id, self._prev[self._tail], self._tail)

    def appendleft(self, block_id: int) -> None:
        self._link(block_id, self._head, self._next[self._head])

    def _link(self, block_id: int, prev: int, nxt: int) -> None:
        assert self._prev[block_id] == _DETACHED, f"block {block_id} is already in the free queue"
        self._next[prev] = block_id
        self._prev[block_id] = prev
        self._next[block_id] = nxt
        self._prev[nxt] = block_id
        self._len += 1
