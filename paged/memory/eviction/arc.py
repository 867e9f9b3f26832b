"""ARC (Megiddo and Modha, FAST '03), the policy proposed for vLLM's prefix cache in #40268.

Blocks seen once (T1) and blocks reused (T2) are kept apart, and the split between them adapts: a
block recomputed soon after T1 evicted it says T1 was too small, one that T2 evicted says T2 was. The
evicted blocks' ghosts (B1, B2) are keyed by block hash, not block id: a block id is reused for other
content as soon as it is evicted, the hash names the content that was lost.
"""

from __future__ import annotations

from collections import OrderedDict

from paged.memory.allocator import NoFreeBlocksError
from paged.memory.eviction.eviction_policy import EvictionPolicy
from paged.memory.eviction.release_bursts import ReleaseBursts


class ARCPolicy(EvictionPolicy):
    """Evicts T1's least recently released block while T1 holds more than its target `recency_target`
    (or T2 has nothing evictable), else T2's; the victim's hash goes to ghost list B1 or B2. A
    published block whose hash is in B1 raises the target (by |B2|/|B1|, at least 1) and one in B2
    lowers it (by |B1|/|B2|), and either goes straight to T2. The cache size c that bounds the target
    and the ghosts (|T1| + |B1| <= c, all four <= 2c) is the most blocks tracked at once.

    Every operation O(1) amortized (OrderedDicts; ghost trimming pops what earlier evictions added).
    Chain order: within a list blocks leave in release order, tails first; a head in T2 while its
    tail is in T1 (the head reused by a shorter prompt) could go first, so a victim gives way to the
    deepest block of its release burst (`ReleaseBursts`).
    """

    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[int, None] = OrderedDict()  # evictable, least recently released first
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        # every tracked block: hash, position, whether it is in T2
        self._hash: dict[int, bytes] = {}
        self._position: dict[int, int] = {}
        self._in_t2: dict[int, bool] = {}
        self._num_t1 = 0  # tracked blocks of T1, in use or evictable
        self._capacity = 0
        self._target = 0.0
        self._bursts = ReleaseBursts()

    @property
    def recency_target(self) -> float:
        """ARC's p: how many blocks T1 may hold before T1 gives up a block rather than T2."""
        return self._target

    def insert(self, block_id: int, block_hash: bytes, position: int) -> None:
        self._bursts.interrupt()
        self._capacity = max(self._capacity, len(self._hash) + 1)
        in_t2 = True
        if block_hash in self._b1:
            self._target = min(self._target + max(len(self._b2) / len(self._b1), 1.0), self._capacity)
            del self._b1[block_hash]
        elif block_hash in self._b2:
            self._target = max(self._target - max(len(self._b1) / len(self._b2), 1.0), 0.0)
            del self._b2[block_hash]
        else:
            in_t2 = False
            self._num_t1 += 1
        self._hash[block_id] = block_hash
        self._position[block_id] = position
        self._in_t2[block_id] = in_t2

    def hit(self, block_id: int) -> None:
        self._bursts.interrupt()
        if self._in_t2[block_id]:
            if block_id in self._t2:
                self._t2.move_to_end(block_id)
            return
        self._in_t2[block_id] = True
        self._num_t1 -= 1
        if block_id in self._t1:
            del self._t1[block_id]
            self._t2[block_id] = None

    def release(self, block_id: int) -> None:
        queue = self._t2 if self._in_t2[block_id] else self._t1
        assert block_id not in queue, f"block {block_id} is already evictable"
        queue[block_id] = None
        self._bursts.released(block_id, self._position[block_id])

    def acquire(self, block_id: int) -> None:
        del (self._t2 if self._in_t2[block_id] else self._t1)[block_id]
        self._bursts.forget(block_id)

    def evict(self) -> int:
        if not self:
            raise NoFreeBlocksError("no evictable block")
        from_t1 = bool(self._t1) and (self._num_t1 > self._target or not self._t2)
        victim = self._bursts.deepest(next(iter(self._t1 if from_t1 else self._t2)))
        ghosts = self._b2 if self._in_t2[victim] else self._b1
        ghosts[self._hash[victim]] = None
        self.remove(victim)
        c = self._capacity
        while self._b1 and self._num_t1 + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._hash) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)
        return victim

    def remove(self, block_id: int) -> None:
        if block_id not in self._hash:
            return
        in_t2 = self._in_t2.pop(block_id)
        (self._t2 if in_t2 else self._t1).pop(block_id, None)
        self._num_t1 -= not in_t2
        self._bursts.forget(block_id)
        del self._hash[block_id], self._position[block_id]

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._t1 or block_id in self._t2
