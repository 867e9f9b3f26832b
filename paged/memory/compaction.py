"""A `BlockManager` whose sequences can hold fewer tokens than they computed (`kv_press`).

`compress(seq, keep)` keeps the held tokens `keep` (indices in table order) and frees the others:
each new block whose tokens are exactly one whole old block, in order, is that block, reused as it
is (shared or prefix-cached, it is only read); every other kept token is copied into a fresh block
(the returned slot pairs, which the executor copies before the next step writes anything). Old
blocks no longer in the table are released, so a prefix-cached block keeps its cache entry and is
never rewritten in place.

The invariant after any compression: a sequence holds `num_tokens - num_evicted` KV slots, and the
token at position p (p >= the first position computed after the last compression) lies in table
slot `p - num_evicted`; attention reads the held slots, RoPE uses the positions (keys were rotated
before they were cached). A compressed sequence publishes no more prefix blocks (its blocks no
longer follow its tokens' hash chain); freeing or recomputing it forgets the compression.

Only what compression can follow: paged blocks without a sliding window, exact reservations, no
swap (the builder refuses the rest before any weights load). A model with KV groups compresses each
full-attention group with one of these (`paged.memory.group_compaction`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paged.memory.allocator import BlockAllocator
from paged.memory.block_manager import BlockManager, _SeqBlocks
from paged.memory.reservation import ExactReservation
from paged.request import Sequence


@dataclass(frozen=True, slots=True)
class Compressed:
    """What a sequence's compressions left: `num_evicted` tokens gone, and the original positions of
    the tokens it held right after the last one (later tokens follow them, one position each)."""

    num_evicted: int
    positions: np.ndarray


class CompactingBlockManager(BlockManager):
    """`BlockManager` plus `compress`; growth, copy-on-write and forks count a compressed sequence's
    held slots (module docstring). Counters: compressions, tokens kept and evicted, blocks freed."""

    def __init__(self, allocator: BlockAllocator, *args: object, **settings: object) -> None:
        super().__init__(allocator, *args, **settings)  # type: ignore[arg-type]
        if allocator.contiguous or self.sliding_window is not None or self.swap_space.allocator is not None:
            raise ValueError("KV compression needs paged blocks without a sliding window or a swap pool")
        if not isinstance(self.reservation, ExactReservation):
            raise ValueError(f"KV compression needs exact reservations, got {type(self.reservation).__name__}")
        self._compressed: dict[int, Compressed] = {}
        self.num_compressions = 0
        self.num_tokens_kept = 0
        self.num_tokens_evicted = 0
        self.num_blocks_freed = 0

    # -- what a press sees -----------------------------------------------------------------------

    @property
    def has_compressed(self) -> bool:
        return bool(self._compressed)

    def num_evicted(self, seq: Sequence) -> int:
        """Tokens of `seq` computed but no longer held: its KV index is its position minus this."""
        done = self._compressed.get(seq.seq_id)
        return 0 if done is None else done.num_evicted

    def held_positions(self, seq: Sequence) -> np.ndarray:
        """The original position of each computed token `seq` holds, in table order."""
        done = self._compressed.get(seq.seq_id)
        if done is None:
            return np.arange(seq.num_computed_tokens)
        resumed = done.positions.shape[0] + done.num_evicted  # the first position after the compression
        return np.concatenate([done.positions, np.arange(resumed, seq.num_computed_tokens)])

    # -- compression -----------------------------------------------------------------------------

    def compress(self, seq: Sequence, keep: np.ndarray) -> np.ndarray | None:
        """Hold only the computed tokens `keep` (ascending indices into `held_positions(seq)`);
        returns the int64 `[n, 2]` (src, dst) slot copies, or None (nothing changed) when the pool
        has too few free blocks for the copies."""
        state = self._seqs[seq.seq_id]
        bs, alloc = self.block_size, self.allocator
        held = self.held_positions(seq)
        assert held.shape[0] == state.num_slots, "compress runs between steps, on computed tokens only"
        num_kept = keep.shape[0]
        chunks, reused = self._chunks(keep)
        num_fresh = len(chunks) - sum(reused)
        if num_fresh > alloc.num_free_blocks:
            return None
        old = state.table
        fresh = iter(alloc.allocate_blocks(num_fresh))
        table = [old[c[0] // bs] if r else next(fresh) for c, r in zip(chunks, reused, strict=True)]
        kept_blocks = {old[c[0] // bs] for c, r in zip(chunks, reused, strict=True) if r}
        copied = np.repeat(~np.array(reused, dtype=bool), bs)[:num_kept]
        old_ids, new_ids = np.asarray(old, dtype=np.int64), np.asarray(table, dtype=np.int64)
        dst = np.arange(num_kept)
        copies = np.stack([old_ids[keep // bs] * bs + keep % bs, new_ids[dst // bs] * bs + dst % bs], axis=1)[copied]
        evicted = state.num_slots - num_kept + self.num_evicted(seq)
        self.ledger.account_table(
            table, [i for i, r in enumerate(reused) if not r], num_kept, state.final - evicted)
        for block_id in old:
            if block_id not in kept_blocks:
                self._release(block_id)
        if state.num_announced > state.num_published:
            self.prefix_index.withdraw(seq, state.num_published, state.num_announced)
            state.num_announced = state.num_published
        self._num_logical_blocks += len(table) - len(old)
        self.num_compressions += 1
        self.num_tokens_kept += num_kept
        self.num_tokens_evicted += state.num_slots - num_kept
        self.num_blocks_freed += len(old) - len(table)
        state.table, state.num_slots = table, num_kept
        self._compressed[seq.seq_id] = Compressed(evicted, held[keep])
        return copies

    def num_fresh_blocks(self, keep: np.ndarray) -> int:
        """Blocks `compress(seq, keep)` takes from the pool for its copies."""
        chunks, reused = self._chunks(keep)
        return len(chunks) - sum(reused)

    def _chunks(self, keep: np.ndarray) -> tuple[list[np.ndarray], list[bool]]:
        """`keep` cut into the new table's blocks, and whether each is one whole old block, in order
        (which then stays that block)."""
        bs = self.block_size
        chunks = [keep[j : j + bs] for j in range(0, keep.shape[0], bs)]
        return chunks, [c.shape[0] == bs and c[0] % bs == 0 and c[-1] == c[0] + bs - 1 for c in chunks]

    # -- what a press step drives (`paged.memory.group_compaction` gives the same for KV groups) --

    @property
    def compacting(self) -> tuple[CompactingBlockManager, ...]:
        """The tables a press compresses, one per compressed KV group: this manager's own."""
        return (self,)

    def compress_each(self, seq: Sequence, keeps: list[np.ndarray]) -> np.ndarray | None:
        """`compress` with the keep set of each of `compacting` (here one)."""
        (keep,) = keeps
        return self.compress(seq, keep)

    # -- growth of compressed sequences ----------------------------------------------------------

    def try_append_slots(self, seq: Sequence) -> list[tuple[int, int]] | None:
        done = self._compressed.get(seq.seq_id)
        if done is None:
            return super().try_append_slots(seq)
        state, bs, alloc = self._seqs[seq.seq_id], self.block_size, self.allocator
        table, evicted = state.table, done.num_evicted
        num_held = len(seq.token_ids) - evicted
        last = state.num_slots
        if (
            self.share_blocks and num_held - 1 == last == seq.num_computed_tokens - evicted and last % bs
            and alloc.refcount(table[last // bs]) == 1
        ):
            self.ledger.append_token(table[last // bs])
            state.num_slots = num_held
            return []
        shared = self._shared_write_targets(seq, state)
        num_new = self._growth_blocks(seq, state)
        if num_new + len(shared) > alloc.num_free_blocks:
            return None
        final = state.final - evicted
        copies = []
        for i in shared:
            src, dst = table[i], alloc.allocate()
            alloc.free(src)
            table[i] = dst
            self.ledger.copy(src, dst, i, final)
            copies.append((src, dst))
        first_new = len(table)
        if num_new:
            table.extend(alloc.allocate_blocks(num_new))
            self._num_logical_blocks += num_new
        grown = range(max(state.num_slots - 1, 0) // bs, min(self._cdiv(num_held), first_new))
        self.ledger.account_table(table, (*grown, *range(first_new, len(table))), num_held, final)
        state.num_slots = num_held
        return copies

    def _growth_blocks(self, seq: Sequence, state: _SeqBlocks) -> int:
        evicted = self.num_evicted(seq)
        if not evicted:
            return super()._growth_blocks(seq, state)
        return max(self._cdiv(len(seq.token_ids) - evicted) - len(state.table), 0)

    def _shared_write_targets(self, seq: Sequence, state: _SeqBlocks) -> list[int]:
        evicted = self.num_evicted(seq)
        if not evicted:
            return super()._shared_write_targets(seq, state)
        refcount, table = self.allocator.refcount, state.table
        if not self.share_blocks:
            return [i for i in range(len(table)) if refcount(table[i]) > 1]
        first = (seq.num_computed_tokens - evicted) // self.block_size
        last = min(self._cdiv(len(seq.token_ids) - evicted), len(table))
        return [i for i in range(first, last) if refcount(table[i]) > 1]

    # -- prefix cache and lifetime ---------------------------------------------------------------

    def mark_computed(self, seq: Sequence) -> None:
        if seq.seq_id not in self._compressed:
            super().mark_computed(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        super().fork(parent, child)
        done = self._compressed.get(parent.seq_id)
        if done is not None:
            self._compressed[child.seq_id] = done

    def free(self, seq: Sequence) -> None:
        super().free(seq)
        self._compressed.pop(seq.seq_id, None)
