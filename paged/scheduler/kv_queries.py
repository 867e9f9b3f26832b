"""What the engine's callers ask of the KV cache, answered by the scheduler, which owns the block
manager: nothing above the scheduler walks to the block manager or its allocator."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from paged.step import KVStats

if TYPE_CHECKING:
    from paged.memory import BlockManager
    from paged.memory.kv_groups import KVGroupManager
    from paged.scheduler.policy import SchedulingPolicy
    from paged.scheduler.preemption import PreemptionMode


class KVQueriesMixin:
    block_manager: BlockManager | KVGroupManager
    policy: SchedulingPolicy
    preemption: PreemptionMode

    def kv_stats(self) -> KVStats:
        """The KV cache now: pool size, blocks in use, and the prefix-cache counters (cumulative
        since the block manager was built)."""
        manager = self.block_manager
        return dataclasses.replace(manager.stats(), num_evictions=manager.allocator.num_evictions)

    def kv_usage(self) -> float:
        """The fraction of the pool's blocks in use; cheap enough to ask after every step."""
        allocator = self.block_manager.allocator
        return 1.0 - allocator.num_free_blocks / allocator.num_blocks

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    @property
    def caches_prefixes(self) -> bool:
        """Whether the allocator keeps a prefix cache (without one, a hit rate means nothing)."""
        return self.block_manager.allocator.caches_prefixes

    def cached_prefix_blocks(self, chain: list[bytes]) -> int:
        """Blocks from the start of `chain` (a prompt's `prompt_block_hashes`) the prefix cache holds now."""
        return self.block_manager.prefix_index.cached_blocks(chain)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefix blocks; False (and nothing dropped) while requests hold blocks."""
        return self.block_manager.allocator.reset_prefix_cache()

    def plugin_parts(self) -> dict[str, Any]:
        """The scheduler's replaceable parts by role: allocator, policy, preemption."""
        return {"allocator": self.block_manager.allocator, "policy": self.policy, "preemption": self.preemption}
