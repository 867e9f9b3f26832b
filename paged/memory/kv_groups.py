"""KV groups per layer type (`paged.kv_layout`): one block table per group per sequence, all drawn
from one shared pool, behind the interface of `BlockManager` so the scheduler does not care.

Each group is a `BlockManager` of its own over the shared allocator, with its group's window: a
sliding-window group frees the blocks that leave its window as the sequence grows, a full-attention
group keeps them. This manager sums what every group needs before any of them takes a block, so
admission (with the watermark), growth and copy-on-write account for all groups against the one
pool, and a step either grows every group's table or none. A pool block holds `num_slots` layers,
the same bytes whichever group holds it, so blocks move between groups as the workload asks.

Prefix hits are the longest prefix every group has cached (`paged.memory.group_prefix`). Swap
preemption is not supported with several groups (the builder refuses it): a preempted sequence is
recomputed.
"""

from __future__ import annotations

from typing import Any

from paged.kv_layout import KVLayout
from paged.memory.allocator import BlockAllocator, NoFreeBlocksError
from paged.memory.block_manager import AllocStatus, BlockManager
from paged.memory.group_prefix import CommonPrefixIndex, GroupKeyedPool
from paged.memory.reservation import Reservation
from paged.request import Request, Sequence
from paged.step import KVStats


class GroupBlocks(BlockManager):
    """One group's tables: a `BlockManager` that also says what a step takes before it takes it,
    so the groups' needs can be summed; its prefix index is the group's `CommonPrefixIndex`."""

    prefix_index: CommonPrefixIndex

    def __init__(self, allocator: BlockAllocator | GroupKeyedPool, index: CommonPrefixIndex, **settings: Any) -> None:
        super().__init__(allocator, **settings)  # type: ignore[arg-type]  # a GroupKeyedPool passes every call through
        self.prefix_index = index

    def admission_status(self, required: int, num_from_free: int, num_fresh: int) -> AllocStatus:
        """`can_allocate`'s answer for a need summed over the groups (`_status` for the terms)."""
        return AllocStatus.NEVER if self._never_fits(required) else self._status(num_from_free, num_fresh)

    def growth_need(self, seq: Sequence) -> int:
        """Blocks the next `append_slots(seq)` takes (new ones and private copies of shared ones),
        after freeing those that left the window."""
        state = self._seqs[seq.seq_id]
        if self.sliding_window is not None:
            self._drop_outside_window(seq, state)
        return self._growth_blocks(seq, state) + len(self._shared_write_targets(seq, state))

    def count_revived(self, block_ids: list[int]) -> None:
        """`block_ids` came out of the free pool while another reference held them (the manager's
        pin during admission): their slots count again, as `allocate` counts a revived block's."""
        for block_id in block_ids:
            self.ledger.account(block_id, self.block_size, 0)


class KVGroupManager:
    """`BlockManager`'s interface over one `GroupBlocks` per group of `layout` (module docstring).
    `block_table(seq)` is group 0's; `group_tables(seq)` every group's, in group order."""

    def __init__(
        self,
        allocator: BlockAllocator,
        layout: KVLayout,
        watermark: float = 0.01,
        reservation: Reservation | None = None,
        *,
        max_model_len: int | None = None,
        share_blocks: bool = True,
    ) -> None:
        if not layout.is_hybrid:
            raise ValueError("one KV group is a plain BlockManager; KVGroupManager is for two or more")
        if allocator.contiguous:
            raise ValueError(f"{type(allocator).__name__} hands out contiguous extents; KV groups need a paged pool")
        self.allocator = allocator
        self.layout = layout
        peers: list[CommonPrefixIndex] = []
        self.groups: list[GroupBlocks] = []
        for g, group in enumerate(layout.groups):
            view = allocator if g == 0 else GroupKeyedPool(allocator, g)
            self.groups.append(self._group_blocks(group.window)(
                view, CommonPrefixIndex(view, peers), watermark=watermark, reservation=reservation,
                max_model_len=max_model_len, sliding_window=group.window, share_blocks=share_blocks,
            ))
        lead = self.groups[0]
        self.reservation = lead.reservation
        self.block_size = lead.block_size
        self.num_total_blocks = lead.num_total_blocks
        self.watermark_blocks = lead.watermark_blocks
        # group 0's: its hashes are today's, so a router's prompt_block_hashes are looked up in it
        self.prefix_index = lead.prefix_index

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def _group_blocks(self, window: int | None) -> type[GroupBlocks]:
        """The manager of a group of layers that attend within `window` tokens (None: all)."""
        return GroupBlocks

    # -- admission -------------------------------------------------------------------------------

    def rejection(self, request: Request) -> str | None:
        return self.groups[0].rejection(request)

    def admission_blocks(self, seq: Sequence) -> int:
        """Pool blocks `seq`'s tables cover once admitted: one table per group."""
        return self.num_groups * self.groups[0].admission_blocks(seq)

    def _hits(self, seq: Sequence) -> list[list[int]]:
        """Every group's cached prefix of `seq`, cut to the length all of them have."""
        own = [g.prefix_index.own_hits(seq) for g in self.groups]
        n = min(map(len, own))
        return [hits[:n] for hits in own]

    def can_allocate(self, *seqs: Sequence) -> AllocStatus:
        """Whether `seqs` fit now, every group's table counted against the one pool."""
        required = sum(map(self.admission_blocks, seqs))
        num_from_free = num_fresh = required
        refcount = self.allocator.refcount
        for seq in seqs:
            for hits in self._hits(seq):
                num_from_free -= sum(1 for b in hits if refcount(b) > 0)
                num_fresh -= len(hits)
        return self.groups[0].admission_status(required, num_from_free, num_fresh)

    def allocate(self, seq: Sequence) -> int:
        """Build every group's table; returns how many tokens are already computed (the same in
        each group). Every group's hits are pinned first: one group's fresh blocks may otherwise
        evict another group's cached-free hit before that group takes it."""
        pinned = self._hits(seq)
        revived = [[b for b in hits if self.allocator.refcount(b) == 0] for hits in pinned]
        for group, hits in zip(self.groups, pinned, strict=True):
            group.prefix_index.match(seq, hits)
        done: list[GroupBlocks] = []
        try:
            for group in self.groups:
                num_hit_tokens = group.allocate(seq)
                done.append(group)
        except NoFreeBlocksError:
            for group in done:
                group.free(seq)
            raise
        finally:
            for hits in pinned:
                for block_id in hits:
                    self.allocator.free(block_id)
        for group, blocks in zip(self.groups, revived, strict=True):
            group.count_revived(blocks)
        return num_hit_tokens

    # -- growth ----------------------------------------------------------------------------------

    def can_append_slots(self, *seqs: Sequence) -> bool:
        """Whether every one of `seqs` can grow now in every group (shared blocks counted per
        holder, as `BlockManager.can_append_slots` does)."""
        need = sum(g.growth_need(seq) for seq in seqs for g in self.groups)
        return need <= self.allocator.num_free_blocks

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        copies = self.try_append_slots(seq)
        if copies is None:
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} cannot grow in all {self.num_groups} KV groups: "
                f"{self.allocator.num_free_blocks} blocks are free"
            )
        return copies

    def try_append_slots(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """Grow `seq` in every group, or (None) in none when the pool cannot give all of them."""
        if self._growth_bound(seq) > self.allocator.num_free_blocks and not self.can_append_slots(seq):
            return None
        return [copy for g in self.groups for copy in g.append_slots(seq)]

    def _growth_bound(self, seq: Sequence) -> int:
        """A bound on what growing `seq` takes from the pool, cheap enough for every decode: every
        group's table has group 0's length, so each needs the same new blocks, plus at most a copy
        of each block the step writes (with `share_blocks`; without, any block it shares)."""
        lead, bs = self.groups[0], self.block_size
        if not lead.share_blocks:
            return self.allocator.num_blocks
        num_tokens = len(seq.token_ids)
        covered = max(num_tokens, self.reservation.growth_slots(seq))
        num_new = max(-(-covered // bs) - len(lead.block_table(seq)), 0)
        num_written = -(-num_tokens // bs) - seq.num_computed_tokens // bs
        return self.num_groups * (num_new + num_written)

    # -- prefix cache ----------------------------------------------------------------------------

    def mark_computed(self, seq: Sequence) -> None:
        for g in self.groups:
            g.mark_computed(seq)

    def awaits_prefix(self, seq: Sequence) -> bool:
        """Group 0's answer: every group computes the same blocks in the same steps."""
        return self.groups[0].awaits_prefix(seq)

    def num_cached_tokens(self, seq: Sequence) -> int:
        return len(self._hits(seq)[0]) * self.block_size

    # -- lifetime --------------------------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        for g in self.groups:
            g.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        for g in self.groups:
            g.free(seq)

    def block_table(self, seq: Sequence) -> list[int]:
        return self.groups[0].block_table(seq)

    def group_tables(self, seq: Sequence) -> list[list[int]]:
        return [g.block_table(seq) for g in self.groups]

    def has_blocks(self, seq: Sequence) -> bool:
        return self.groups[0].has_blocks(seq)

    # -- swap (not with KV groups: module docstring) ---------------------------------------------

    def can_swap_out(self, *seqs: Sequence) -> bool:
        """Never: a swap mode falls back to recomputing."""
        return False

    def swap_out(self, *seqs: Sequence) -> list[tuple[int, int]]:
        raise NoFreeBlocksError("KV groups do not swap: preempted sequences are recomputed")

    def can_swap_in(self, *seqs: Sequence) -> AllocStatus:
        return AllocStatus.NEVER

    def swap_in(self, *seqs: Sequence) -> list[tuple[int, int]]:
        raise NoFreeBlocksError("KV groups do not swap: no sequence is swapped out")

    def is_swapped(self, seq: Sequence) -> bool:
        return False

    # -- accounting ------------------------------------------------------------------------------

    def stats(self, blocked_blocks: int = 0) -> KVStats:
        """The pool now, every group's slots summed; `num_tokens_held` is the largest group's count
        (a full-attention group holds every token the sequences attend to)."""
        parts = [g.stats(blocked_blocks) for g in self.groups]
        lead = parts[0]
        return KVStats(
            num_total_blocks=lead.num_total_blocks,
            num_allocated_blocks=lead.num_allocated_blocks,
            num_free_blocks=lead.num_free_blocks,
            num_cached_free_blocks=lead.num_cached_free_blocks,
            num_token_slots_used=sum(p.num_token_slots_used for p in parts),
            block_size=lead.block_size,
            num_queried_tokens=lead.num_queried_tokens,
            num_hit_tokens=lead.num_hit_tokens,
            num_reserved_slots=sum(p.num_reserved_slots for p in parts),
            num_unassigned_blocks=lead.num_unassigned_blocks,
            num_stranded_free_blocks=lead.num_stranded_free_blocks,
            num_cpu_blocks=0,
            num_free_cpu_blocks=0,
            num_logical_blocks=sum(p.num_logical_blocks for p in parts),
            num_tokens_held=max(p.num_token_slots_used for p in parts),
        )
