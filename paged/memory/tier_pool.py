"""One tier below the device for evicted prefix blocks (host memory, or files on disk): which block
hash each of its slots holds, and the tier's own eviction policy over them.

A tier is a cache of content-addressed blocks like the device's prefix cache, so it reuses the
device's `EvictionPolicy` seam: the policy keys entries by slot id as the device's keys them by
block id. An entry that the current step copies into or out of is pinned (in use to the policy)
until the step's copies are handed to the executor: its bytes must not be replaced before they
move. Every other entry is evictable; a full tier evicts the policy's victim to take a new block.
"""

from __future__ import annotations

from paged.memory.eviction import EvictionPolicy

# (slot, block hash, position in its hash chain) of an entry a full tier evicted
Evicted = tuple[int, bytes, int]


class TierPool:
    """`capacity` slots of one tier and the block hash each holds."""

    def __init__(self, name: str, capacity: int, policy: EvictionPolicy) -> None:
        if capacity <= 0:
            raise ValueError(f"the {name} tier needs at least one slot, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.policy = policy
        self._slot_of: dict[bytes, int] = {}
        self._hash_of: list[bytes | None] = [None] * capacity
        self._position = [0] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: slot 0 first
        # ordered, so the policy sees the releases in the order the step used the entries
        self._pinned: dict[int, None] = {}

    def __len__(self) -> int:
        return len(self._slot_of)

    def slot(self, block_hash: bytes) -> int | None:
        return self._slot_of.get(block_hash)

    def position(self, slot: int) -> int:
        return self._position[slot]

    def add(self, block_hash: bytes, position: int) -> tuple[int, Evicted | None] | None:
        """A slot for `block_hash` (not held yet), pinned for this step, and the entry evicted to
        make room (None if a slot was free); None when the tier is full and every entry is pinned."""
        assert block_hash not in self._slot_of, f"the {self.name} tier already holds this block"
        evicted = None
        if self._free:
            slot = self._free.pop()
        elif len(self.policy):
            slot = self.policy.evict()
            old = self._hash_of[slot]
            assert old is not None and slot not in self._pinned, f"{self.name} tier evicted a pinned slot {slot}"
            del self._slot_of[old]
            evicted = (slot, old, self._position[slot])
        else:
            return None
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._position[slot] = position
        self.policy.insert(slot, block_hash, position)
        self._pinned[slot] = None
        return slot, evicted

    def pin(self, slot: int) -> None:
        """A hit on `slot`: the step reads it, so it stays until the step's copies are handed out."""
        if slot not in self._pinned:
            self.policy.acquire(slot)
            self._pinned[slot] = None
        self.policy.hit(slot)

    def touch(self, slot: int) -> None:
        """The block at `slot` was wanted again (evicted from above while this tier held it): a reuse,
        as a hit and a release are to the device's policy."""
        if slot in self.policy:
            self.policy.acquire(slot)
            self.policy.hit(slot)
            self.policy.release(slot)
        else:
            self.policy.hit(slot)

    def unpin_all(self) -> None:
        """The step's copies are handed out: every pinned entry is evictable again."""
        for slot in self._pinned:
            self.policy.release(slot)
        self._pinned.clear()

    def drop(self, slot: int) -> None:
        """Forget `slot`'s entry: its bytes are gone or bad."""
        block_hash = self._hash_of[slot]
        assert block_hash is not None, f"{self.name} tier slot {slot} holds nothing"
        self._pinned.pop(slot, None)
        self.policy.remove(slot)
        del self._slot_of[block_hash]
        self._hash_of[slot] = None
        self._free.append(slot)
