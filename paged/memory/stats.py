"""A snapshot of KV cache occupancy, taken every engine step."""

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
