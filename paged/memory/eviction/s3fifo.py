"""S3-FIFO (Yang et al., SOSP '23): a small probationary FIFO, a main FIFO, and a ghost FIFO of hashes.

Most cached blocks are never reused (one-hit wonders: a request's own tail); S3-FIFO lets them leave
quickly through the small queue, promotes the ones reused while there to the main queue, and
remembers the hashes of recent small-queue evictions, so a block recomputed soon after its eviction
goes straight to the main queue. Here the queues hold the evictable blocks in the order they entered
the free pool (a block in use is in neither until released).
"""

from __future__ import annotations

from collections import OrderedDict

from paged.memory.allocator import NoFreeBlocksError
from paged.memory.eviction.eviction_policy import EvictionPolicy
from paged.memory.eviction.release_bursts import ReleaseBursts


class S3FIFOPolicy(EvictionPolicy):
    """A block starts in the small queue (or the main one if its hash is a ghost). To evict: while
    the small queue holds more than `small_ratio` of the cached blocks (or the main one has nothing
    evictable), take the small queue's oldest: reused since it entered (frequency > 0) it moves to
    the main queue, else it is evicted and its hash becomes a ghost; otherwise take the main queue's
    oldest: reused, it goes to the back with its frequency less one, else it is evicted. Frequencies
    saturate at `max_freq`; the ghost queue holds as many hashes as the main queue's share of the
    largest cache seen.

    insert, hit, release, acquire, remove: O(1); evict: O(1) amortized (every move spends a use that
    a hit added).
    Chain order: tails are released first, and a head is reused at least as often as its tail, so a
    head is promoted whenever its tail is; a victim gives way to the deepest block of its release
    burst (`ReleaseBursts`) for the other cases.
    """

    name = "s3fifo"

    def __init__(self, small_ratio: float = 0.1, max_freq: int = 3) -> None:
        if not 0.0 < small_ratio < 1.0:
            raise ValueError(f"small_ratio must be in (0, 1), got {small_ratio!r}")
        if max_freq < 1:
            raise ValueError(f"max_freq must be >= 1, got {max_freq!r}")
        self.small_ratio = small_ratio
        self.max_freq = max_freq
        self._small: OrderedDict[int, None] = OrderedDict()  # evictable, oldest first
        self._main: OrderedDict[int, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        # every tracked block: hash, position, uses since entering its queue, whether in the main queue
        self._hash: dict[int, bytes] = {}
        self._position: dict[int, int] = {}
        self._freq: dict[int, int] = {}
        self._in_main: dict[int, bool] = {}
        self._num_small = 0  # tracked blocks of the small queue, in use or evictable
        self._capacity = 0  # the most blocks tracked at once: the cache size S3-FIFO sizes its queues by
        self._bursts = ReleaseBursts()

    def insert(self, block_id: int, block_hash: bytes, position: int) -> None:
        self._bursts.interrupt()
        in_main = block_hash in self._ghost  # evicted from the small queue lately: it was wanted again
        if in_main:
            del self._ghost[block_hash]
        self._hash[block_id] = block_hash
        self._position[block_id] = position
        self._freq[block_id] = 0
        self._in_main[block_id] = in_main
        self._num_small += not in_main
        self._capacity = max(self._capacity, len(self._hash))

    def hit(self, block_id: int) -> None:
        self._bursts.interrupt()
        self._freq[block_id] = min(self._freq[block_id] + 1, self.max_freq)

    def release(self, block_id: int) -> None:
        queue = self._main if self._in_main[block_id] else self._small
        assert block_id not in queue, f"block {block_id} is already evictable"
        queue[block_id] = None
        self._bursts.released(block_id, self._position[block_id])

    def acquire(self, block_id: int) -> None:
        del (self._main if self._in_main[block_id] else self._small)[block_id]
        self._bursts.forget(block_id)

    def evict(self) -> int:
        self._bursts.interrupt()
        if not self:
            raise NoFreeBlocksError("no evictable block")
        while True:
            if self._small and (self._num_small > self.small_ratio * len(self._hash) or not self._main):
                block_id = next(iter(self._small))
                if self._freq[block_id] == 0:
                    break
                del self._small[block_id]
                self._main[block_id] = None
                self._in_main[block_id] = True
                self._num_small -= 1
                self._freq[block_id] = 0
            else:
                block_id = next(iter(self._main))
                if self._freq[block_id] == 0:
                    break
                self._main.move_to_end(block_id)
                self._freq[block_id] -= 1
        victim = self._bursts.deepest(block_id)
        if not self._in_main[victim]:
            self._ghost[self._hash[victim]] = None
            while len(self._ghost) > max(1, round(self._capacity * (1 - self.small_ratio))):
                self._ghost.popitem(last=False)
        self.remove(victim)
        return victim

    def remove(self, block_id: int) -> None:
        if block_id not in self._hash:
            return
        in_main = self._in_main.pop(block_id)
        (self._main if in_main else self._small).pop(block_id, None)
        self._num_small -= not in_main
        self._bursts.forget(block_id)
        del self._hash[block_id], self._position[block_id], self._freq[block_id]

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._small or block_id in self._main
