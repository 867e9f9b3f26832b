"""A snapshot of KV cache occupancy, taken every engine step, and its four-way breakdown.

The PagedAttention paper (Fig. 2) splits KV memory into token states, reservation (slots held for
tokens a request will still produce), internal fragmentation (slots held that it will never use)
and external fragmentation (memory no request can be given). Every slot of the pool is in exactly
one of those or free, so the five shares sum to 1. Sharing is measured apart: how many blocks the
sequences' tables name versus how many distinct blocks they hold.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVStats:
    num_total_blocks: int
    num_allocated_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int
    num_token_slots_used: int
    block_size: int
    # cumulative since the manager was built: prompt tokens looked up in / found in the prefix cache
    num_queried_tokens: int = 0
    num_hit_tokens: int = 0
    # empty slots of assigned blocks that their sequence will fill before it reaches its length limit
    num_reserved_slots: int = 0
    # allocated blocks that no sequence holds (a buddy allocator's rounding up to a power of two)
    num_unassigned_blocks: int = 0
    # free blocks in pieces too small for the request that waits for memory
    num_stranded_free_blocks: int = 0
    num_cpu_blocks: int = 0
    num_free_cpu_blocks: int = 0
    # block-table entries over all sequences: the blocks they would hold if nothing were shared
    num_logical_blocks: int = 0

    @property
    def sharing_saving(self) -> float:
        """The paper's memory saving (Fig. 14, 15): blocks saved by sharing (between a request's
        samples or beams, and prefix-cache hits) / blocks the same sequences would hold without."""
        if self.num_logical_blocks == 0:
            return 0.0
        held = self.num_allocated_blocks - self.num_unassigned_blocks
        return 1.0 - held / self.num_logical_blocks

    @property
    def kv_usage(self) -> float:
        """Allocated blocks / total: the memory the KV cache holds."""
        return self.num_allocated_blocks / self.num_total_blocks

    @property
    def token_state_fraction(self) -> float:
        """Slots holding token states / allocated slots: 1 minus internal fragmentation."""
        if self.num_allocated_blocks == 0:
            return 1.0
        return self.num_token_slots_used / (self.num_allocated_blocks * self.block_size)

    @property
    def num_total_slots(self) -> int:
        return self.num_total_blocks * self.block_size

    @property
    def num_internal_frag_slots(self) -> int:
        """Slots of assigned blocks that hold no token state and never will."""
        assigned = (self.num_allocated_blocks - self.num_unassigned_blocks) * self.block_size
        return assigned - self.num_token_slots_used - self.num_reserved_slots

    @property
    def num_external_frag_slots(self) -> int:
        return (self.num_unassigned_blocks + self.num_stranded_free_blocks) * self.block_size

    def breakdown(self) -> dict[str, float]:
        """Shares of the whole pool: token states, reserved, internal, external fragmentation, free."""
        total = self.num_total_slots
        token = self.num_token_slots_used / total
        reserved = self.num_reserved_slots / total
        internal = self.num_internal_frag_slots / total
        external = self.num_external_frag_slots / total
        free = (self.num_free_blocks - self.num_stranded_free_blocks) * self.block_size / total
        return {"token_state": token, "reserved": reserved, "internal_frag": internal,
                "external_frag": external, "free": free}
