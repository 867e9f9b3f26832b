"""Chain order for policies that do not evict by release order: cut a chain from its tail.

A policy ranks blocks by frequency, insertion time or cost, and a chain's head can rank below its
tail; evicting the head first would leave the tail cached but unreachable. The policy sees no parent
links, only positions, but the block manager frees a table last block first in one burst of calls, so
a release at position p right after one at p + 1 (nothing in between) is the previous block's parent.
Each burst is kept in release order (deepest first); when the policy picks a victim, the deepest block
of its burst that is still evictable goes instead (the leaves-first rule of SGLang's radix cache).

A burst can link wrongly only when one sequence's free stops above position 0 (a shared or hashless
block) at position q and the next one's tail sits at exactly q - 1; that only reorders evictable
blocks. Unknown positions (all 0) link nothing.
"""

from __future__ import annotations


class _Burst:
    __slots__ = ("blocks", "start")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.start = 0  # blocks before it have all left the burst


class ReleaseBursts:
    """The release bursts of the evictable blocks; O(1) per call, `deepest` O(1) amortized (a
    burst's start only moves forward)."""

    def __init__(self) -> None:
        self._burst_of: dict[int, _Burst] = {}
        self._open: _Burst | None = None
        self._open_position = -1

    def released(self, block_id: int, position: int) -> None:
        """`block_id` at `position` became evictable: it extends the open burst if it is the parent
        of the block released just before."""
        burst = self._open
        if burst is None or position != self._open_position - 1:
            burst = self._open = _Burst()
        burst.blocks.append(block_id)
        self._burst_of[block_id] = burst
        self._open_position = position

    def interrupt(self) -> None:
        """Any other event ends the open burst: the next release starts a new one."""
        self._open = None

    def forget(self, block_id: int) -> None:
        """`block_id` is no longer evictable (acquired, evicted, removed)."""
        self._open = None
        self._burst_of.pop(block_id, None)

    def deepest(self, block_id: int) -> int:
        """The deepest still-evictable block released in the same burst as the evictable `block_id`
        (`block_id` itself when it is the deepest, or was released alone)."""
        burst = self._burst_of.get(block_id)
        if burst is None:
            return block_id
        while self._burst_of.get(burst.blocks[burst.start]) is not burst:
            burst.start += 1
        return burst.blocks[burst.start]
