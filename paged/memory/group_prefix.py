"""Prefix caching with KV groups per layer type (`paged.kv_layout`): one hash chain per group over one
shared pool, and the rule for what a prefix hit is.

Every group caches the same tokens' KV in blocks of its own, so a block hash alone cannot name a
block: group 0 keeps today's chained hashes (a one-group cache and a router's `prompt_block_hashes`
agree with it) and group g > 0 keys the same chain mixed with g. A prefix is a hit only as far as
every group has it cached: a token's KV must be in every layer before its computation can be
skipped. The refinement of vLLM #14097 (a sliding-window group needs only the blocks its last
window reads, not the whole prefix) is left out: a windowed group's evicted early blocks end the hit.
"""

from __future__ import annotations

from typing import Any

import xxhash

from paged.memory.allocator import BlockAllocator
from paged.memory.prefix_index import PrefixIndex
from paged.request import Sequence


class GroupKeyedPool:
    """The shared allocator as group `group` (> 0) sees it: every call passes through, the prefix
    cache's keys are mixed with the group index so that groups never hit each other's blocks."""

    def __init__(self, pool: BlockAllocator, group: int) -> None:
        if group <= 0:
            raise ValueError(f"group 0 uses the pool itself (its hashes unchanged), got group {group}")
        self.pool = pool
        self._salt = group.to_bytes(4, "little")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)

    def _key(self, block_hash: bytes) -> bytes:
        return xxhash.xxh3_128_digest(block_hash + self._salt)

    def match(self, block_hash: bytes) -> int | None:
        return self.pool.match(self._key(block_hash))

    def peek(self, block_hash: bytes) -> int | None:
        return self.pool.peek(self._key(block_hash))

    def insert(self, block_id: int, block_hash: bytes, position: int = 0) -> None:
        """`position`: the block's index in its hash chain (what an eviction policy orders by)."""
        self.pool.insert(block_id, self._key(block_hash), position)


class CommonPrefixIndex(PrefixIndex):
    """One group's prefix index whose hits stop where any group's chain misses (module docstring).

    `peers` is the list of every group's index, this one included, shared by all of them."""

    def __init__(self, allocator: BlockAllocator | GroupKeyedPool, peers: list[CommonPrefixIndex]) -> None:
        super().__init__(allocator)  # type: ignore[arg-type]  # a GroupKeyedPool passes every call through
        self.peers = peers
        peers.append(self)

    def own_hits(self, seq: Sequence) -> list[int]:
        """This group's cached prefix of `seq`, whatever the other groups hold."""
        return super().lookup(seq)

    def lookup(self, seq: Sequence) -> list[int]:
        hits = self.own_hits(seq)
        for peer in self.peers:
            if not hits:
                break
            if peer is not self:
                del hits[len(peer.own_hits(seq)) :]
        return hits
