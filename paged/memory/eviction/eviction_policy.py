"""The eviction seam: which unreferenced cached block a full pool gives up first.

The prefix-caching allocator keeps the bookkeeping (refcounts, hash -> block) and asks a policy only
when it must evict; the tiers below the device (host memory, disk) ask their own policy the same
question about their slots. So a policy is keyed by an int id (a block id, or a tier's slot id) and
sees the cache's events, not the allocator: a block published, hit, released (refcount 0: it may be
evicted now), acquired again by a hit, or forgotten.

Chain order: a chain's tail must go before its head, since a lookup walks a chain from its head and a
tail without its head is never hit again. Every policy documents how it honours that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar


class EvictionPolicy(ABC):
    """Tracks the cached entries it was told about and orders the EVICTABLE ones (released and not
    acquired since). `insert` comes while the entry is in use; `hit` may come in use or not;
    `release` / `acquire` move it into and out of the evictable set; `evict` and `remove` forget it.
    `evict` raises `NoFreeBlocksError` when nothing is evictable."""

    # the config's name for the policy (`allocator/eviction=<name>`), reported as summary.json's eviction_policy
    name: ClassVar[str]

    @abstractmethod
    def insert(self, block_id: int, block_hash: bytes, position: int) -> None:
        """`block_id` was published under `block_hash`, `position` blocks deep in its hash chain (0: first)."""

    @abstractmethod
    def hit(self, block_id: int) -> None:
        """A prefix lookup matched `block_id` (a reuse: recency, frequency)."""

    @abstractmethod
    def release(self, block_id: int) -> None:
        """`block_id` lost its last reference: it is evictable now."""

    @abstractmethod
    def acquire(self, block_id: int) -> None:
        """An evictable `block_id` was revived by a hit: it is no longer evictable."""

    @abstractmethod
    def evict(self) -> int:
        """Choose an evictable entry, forget it and return its id."""

    @abstractmethod
    def remove(self, block_id: int) -> None:
        """Forget `block_id`, evictable or not (`reset_prefix_cache`)."""

    @abstractmethod
    def __len__(self) -> int:
        """How many entries are evictable now."""

    @abstractmethod
    def __contains__(self, block_id: object) -> bool:
        """Whether `block_id` is evictable now."""
