"""`BlockManager`'s memory breakdown (its base class): the cache's counts as `KVStats`, and the
block counts a fast-forward window's statistics read at its block edges."""

from __future__ import annotations

from paged.memory.allocator import BlockAllocator
from paged.memory.prefix_index import PrefixIndex
from paged.memory.slot_ledger import SlotLedger
from paged.step import KVStats


class AccountingMixin:
    """`stats` and `block_counts`; `BlockManager.__init__` sets the state they read."""

    allocator: BlockAllocator
    cpu_allocator: BlockAllocator | None
    ledger: SlotLedger
    prefix_index: PrefixIndex
    num_total_blocks: int
    block_size: int
    num_queried_tokens: int
    num_hit_tokens: int
    _num_logical_blocks: int

    def stats(self, blocked_blocks: int = 0) -> KVStats:
        """The cache now; `blocked_blocks` is what the request waiting for memory needs (0 when none
        waits), which decides what free memory is stranded."""
        num_free = self.allocator.num_free_blocks
        cpu = self.cpu_allocator
        return KVStats(
            num_total_blocks=self.num_total_blocks,
            num_allocated_blocks=self.num_total_blocks - num_free,
            num_free_blocks=num_free,
            num_cached_free_blocks=self.allocator.num_cached_free_blocks,
            num_token_slots_used=self.ledger.num_used,
            block_size=self.block_size,
            num_queried_tokens=self.num_queried_tokens,
            num_hit_tokens=self.num_hit_tokens,
            num_reserved_slots=self.ledger.num_reserved,
            num_unassigned_blocks=self.allocator.num_unassigned_blocks,
            num_stranded_free_blocks=self.allocator.num_stranded_free_blocks(blocked_blocks) if blocked_blocks else 0,
            num_cpu_blocks=cpu.num_blocks if cpu else 0,
            num_free_cpu_blocks=cpu.num_free_blocks if cpu else 0,
            num_logical_blocks=self._num_logical_blocks, **self.prefix_index.tier_counts(),
        )

    def block_counts(self) -> tuple[int, int, int, int]:
        """`stats()`'s total, free, unassigned and logical blocks, without building it (a
        fast-forward window's statistics at its block edges)."""
        alloc = self.allocator
        return self.num_total_blocks, alloc.num_free_blocks, alloc.num_unassigned_blocks, self._num_logical_blocks
