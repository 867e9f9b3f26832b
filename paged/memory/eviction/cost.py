"""Cost-aware eviction (the idea of vLLM #23641): keep what is expensive to recompute and often reused.

A block's value is its uses times the cost of recomputing it. Recomputing a block runs its tokens
through every layer: the linear layers cost the same at any depth, attention over a block `p` blocks
into its chain reads the `p` blocks before it too, so the cost grows linearly with depth:
`1 + depth_cost * position` in units of a first block. `depth_cost` is attention's share of a block's
work per block of context; it is small for a short context on a large model and larger for long chains
on a small one.
"""

from __future__ import annotations

from paged.memory.eviction.lfu import LFUPolicy


class CostPolicy(LFUPolicy):
    """LFU's use counts weighted by recompute cost: evicts the evictable block of least uses x recompute
    cost; ties go to the deeper block, then the older release.

    insert, hit (in use), acquire, remove: O(1); release, hit (evictable), evict: O(log n) amortized.
    Chain order: a deep block's higher cost can rank it above its head, so the score alone does not
    honour it; a victim gives way to the deepest block of its release burst (`ReleaseBursts`), so a
    chain is still cut from its tail.
    """

    name = "cost"

    def __init__(self, depth_cost: float = 0.1) -> None:
        if not depth_cost >= 0:
            raise ValueError(f"depth_cost must be >= 0, got {depth_cost!r}")
        super().__init__()
        self.depth_cost = depth_cost

    def recompute_cost(self, position: int) -> float:
        """What recomputing a block `position` blocks deep costs, in units of a chain's first block."""
        return 1.0 + self.depth_cost * position

    def _score(self, block_id: int) -> float:
        return self._count[block_id] * self.recompute_cost(self._position[block_id])
