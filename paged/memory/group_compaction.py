"""KV compression (`kv_press`) on a model with several KV groups (`paged.memory.kv_groups`): each
full-attention group is compressed with its own keep set, on its own table, freeing its own blocks.

A sliding-window group is left alone: it frees the blocks that leave its window already, and its
kernels count the window in KV indices, which a compression would shift. Each full-attention group
is a `CompactingBlockManager` over the shared pool; a press judges every such group of a sequence
from that group's norms or scores and keeps the same number of tokens in each (its budget), and the
groups are compressed together or not at all. So a sequence has one evicted count, which every
compressed group's KV indices are offset by (`SchedulerOutput.kv_offsets`) while the windowed
groups' are not (`KVLayout.full_groups`), and each group remembers its own kept positions. A
group's copies move tokens between its own blocks; a pool block holds one group's `num_slots` layers,
so `copy_slots` over the `num_slots` KV tensors moves exactly that group's K/V.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paged.kv_layout import KVLayout
from paged.memory.allocator import BlockAllocator
from paged.memory.compaction import CompactingBlockManager
from paged.memory.kv_groups import GroupBlocks, KVGroupManager
from paged.request import Sequence


class CompactingGroupBlocks(CompactingBlockManager, GroupBlocks):
    """A full-attention group's tables that a press can compress."""


class CompactingGroupManager(KVGroupManager):
    """`KVGroupManager` whose full-attention groups compress (module docstring); `compacting` are
    their managers, in group order."""

    def __init__(self, allocator: BlockAllocator, layout: KVLayout, *args: Any, **settings: Any) -> None:
        if not layout.full_groups:
            raise ValueError("KV compression needs a group of full-attention layers; every group has a window")
        super().__init__(allocator, layout, *args, **settings)
        self.compressed_groups = layout.full_groups
        parts = [self.groups[g] for g in layout.full_groups]
        assert all(isinstance(p, CompactingBlockManager) for p in parts)
        self.compacting: tuple[CompactingBlockManager, ...] = tuple(parts)  # type: ignore[arg-type]

    def _group_blocks(self, window: int | None) -> type[GroupBlocks]:
        return CompactingGroupBlocks if window is None else GroupBlocks

    @property
    def has_compressed(self) -> bool:
        return self.compacting[0].has_compressed

    def num_evicted(self, seq: Sequence) -> int:
        """Tokens of `seq` that every compressed group evicted (the same count in each)."""
        return self.compacting[0].num_evicted(seq)

    def compress_each(self, seq: Sequence, keeps: list[np.ndarray]) -> np.ndarray | None:
        """Compress each of `compacting` to its keep set, all of them or (None: too few free blocks
        for every group's copies) none; returns every group's slot copies."""
        counts = [k.shape[0] for k in keeps]
        assert len(keeps) == len(self.compacting)
        if len(set(counts)) > 1:
            raise ValueError(f"a KV press kept {counts} tokens of sequence {seq.seq_id} in KV groups "
                             f"{list(self.compressed_groups)}: it must keep as many in each group (its budget)")
        need = sum(part.num_fresh_blocks(keep) for part, keep in zip(self.compacting, keeps, strict=True))
        if need > self.allocator.num_free_blocks:
            return None
        copies = [part.compress(seq, keep) for part, keep in zip(self.compacting, keeps, strict=True)]
        assert all(c is not None for c in copies)
        return np.concatenate(copies)  # type: ignore[arg-type]

    def _growth_bound(self, seq: Sequence) -> int:
        """KVGroupManager's bound assumes every table has group 0's length, which a compressed
        group's has not: a compressed sequence counts what each group needs."""
        if self.num_evicted(seq):
            return sum(g.growth_need(seq) for g in self.groups)
        return super()._growth_bound(seq)
