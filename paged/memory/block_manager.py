"""Maps sequences to KV blocks: admission, growth, copy-on-write, prefix reuse and accounting."""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass

from paged.memory.allocator import BlockAllocator, NoFreeBlocksError
from paged.memory.hashing import block_hash
from paged.memory.reservation import ExactReservation, Reservation
from paged.memory.stats import KVStats
from paged.request import Sequence


class AllocStatus(enum.Enum):
    OK = "ok"
    LATER = "later"
    NEVER = "never"


@dataclass(slots=True)
class _SeqBlocks:
    table: list[int]
    num_slots: int  # token slots filled, i.e. seq.num_tokens at the last allocate/append
    num_published: int = 0  # leading blocks already inserted into the prefix cache


class BlockManager:
    """The scheduler's view of KV memory; the allocator below it only knows block ids.

    Contract with the caller: after `allocate` returns h, the caller sets
    `seq.num_computed_tokens = h`; after a step writes KV it advances `num_computed_tokens` and
    calls `mark_computed`. Writes only ever go to positions >= `num_computed_tokens`, which is
    what `append_slots` makes private (copy-on-write) before a step.

    How many slots a table covers beyond the tokens (none for paged allocation) is the
    `reservation`'s decision, at admission and before each growth step.
    """

    def __init__(
        self, allocator: BlockAllocator, watermark: float = 0.01, reservation: Reservation | None = None
    ) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.allocator = allocator
        self.reservation = reservation or ExactReservation()
        self.block_size = allocator.block_size
        self.num_total_blocks = allocator.num_blocks
        self.watermark_blocks = int(watermark * self.num_total_blocks)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self._caching = allocator.caches_prefixes
        self._seqs: dict[int, _SeqBlocks] = {}
        # Hash chains are cached per Sequence object (weakly, so aborted waiting sequences don't
        # leak): admission re-asks every step while a sequence waits, and survives preemption.
        self._chains: weakref.WeakKeyDictionary[Sequence, list[bytes]] = weakref.WeakKeyDictionary()
        # Filled slots per physical block. A shared block is never written (CoW first), so every
        # sequence referencing it agrees on its fill; summing once per block counts token states.
        self._fill = [0] * self.num_total_blocks
        self._slots_used = 0

    # -- admission -------------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence) -> AllocStatus:
        required = self.admission_blocks(seq)
        if self.num_total_blocks - required < self.watermark_blocks:
            return AllocStatus.NEVER
        hits = self._peek_hits(seq)
        # Reviving a cached-free block takes it out of the free pool just like a fresh one.
        live_hits = sum(1 for b in hits if self.allocator.refcount(b) > 0)
        if self.allocator.num_free_blocks - (required - live_hits) >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq: Sequence) -> int:
        """Build `seq`'s block table for all its tokens; returns how many are already computed."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} already has blocks")
        bs, alloc = self.block_size, self.allocator
        num_tokens = seq.num_tokens
        required = self.admission_blocks(seq)
        hits = self._peek_hits(seq)
        needed = required - sum(1 for b in hits if alloc.refcount(b) > 0)
        if needed > alloc.num_free_blocks:
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {needed} new blocks, {alloc.num_free_blocks} are free"
            )
        table: list[int] = []
        chain = self._chains.get(seq, ())
        for i, expected in enumerate(hits):
            block_id = alloc.match(chain[i])
            assert block_id == expected, "prefix cache changed between peek and match"
            if alloc.refcount(block_id) == 1:
                self._fill[block_id] = bs
                self._slots_used += bs
            table.append(block_id)
        for i in range(len(hits), required):
            block_id = alloc.allocate()
            fill = min(bs, max(num_tokens - i * bs, 0))
            self._fill[block_id] = fill
            self._slots_used += fill
            table.append(block_id)
        self._seqs[seq.seq_id] = _SeqBlocks(table, num_tokens, len(hits))
        num_hit_tokens = len(hits) * bs
        if self._caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens
        return num_hit_tokens

    # -- growth ----------------------------------------------------------------------------------

    def can_append_slots(self, seq: Sequence) -> bool:
        state = self._seqs[seq.seq_id]
        num_new = self._growth_blocks(seq, state)
        return num_new + len(self._shared_write_targets(seq, state)) <= self.allocator.num_free_blocks

    def append_slots(self, seq: Sequence) -> list[tuple[int, int]]:
        """Cover all of `seq`'s tokens; returns (src, dst) block copies the executor must do first."""
        copies = self.try_append_slots(seq)
        if copies is None:
            state = self._seqs[seq.seq_id]
            needed = self._growth_blocks(seq, state) + len(self._shared_write_targets(seq, state))
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {needed} blocks, {self.allocator.num_free_blocks} are free"
            )
        return copies

    def try_append_slots(self, seq: Sequence) -> list[tuple[int, int]] | None:
        """`append_slots` when the free blocks suffice, else None and nothing changes: the
        scheduler's per-sequence decode check and growth in one pass."""
        state = self._seqs[seq.seq_id]
        table, bs, alloc = state.table, self.block_size, self.allocator
        num_tokens = len(seq.token_ids)
        last = state.num_slots
        if (
            num_tokens - 1 == last == seq.num_computed_tokens and last % bs
            and alloc.refcount(table[last // bs]) == 1 and self.reservation.growth_slots(seq) <= len(table) * bs
        ):
            # the common decode step: one token into a private block that has room
            self._fill[table[last // bs]] += 1
            self._slots_used += 1
            state.num_slots = num_tokens
            return []
        shared = self._shared_write_targets(seq, state)
        num_new = self._growth_blocks(seq, state)
        if num_new + len(shared) > alloc.num_free_blocks:
            return None
        copies = []
        for i in shared:
            src = table[i]
            dst = alloc.allocate()
            alloc.free(src)
            table[i] = dst
            self._fill[dst] = self._fill[src]
            self._slots_used += self._fill[src]
            copies.append((src, dst))
        table.extend(alloc.allocate() for _ in range(num_new))
        # Only the old last block and the blocks after it gain filled slots.
        for i in range(max(state.num_slots - 1, 0) // bs, self._cdiv(num_tokens)):
            block_id = table[i]
            fill = min(bs, num_tokens - i * bs)
            self._slots_used += fill - self._fill[block_id]
            self._fill[block_id] = fill
        state.num_slots = num_tokens
        return copies

    def _shared_write_targets(self, seq: Sequence, state: _SeqBlocks) -> list[int]:
        """Indices of existing blocks that this step writes into but other tables also hold."""
        refcount, table, bs = self.allocator.refcount, state.table, self.block_size
        first = seq.num_computed_tokens // bs
        last = min(-(-len(seq.token_ids) // bs), len(table))
        if last - first == 1:  # a decode step writes one block
            return [first] if refcount(table[first]) > 1 else []
        return [i for i in range(first, last) if refcount(table[i]) > 1]

    def admission_blocks(self, seq: Sequence) -> int:
        """Blocks `seq`'s table covers once admitted: its tokens, or what the reservation asks."""
        return self._cdiv(max(seq.num_tokens, self.reservation.admission_slots(seq)))

    def _growth_blocks(self, seq: Sequence, state: _SeqBlocks) -> int:
        """Blocks to add to the table before the step that grows `seq` to `seq.num_tokens`."""
        covered = max(len(seq.token_ids), self.reservation.growth_slots(seq))
        return max(-(-covered // self.block_size) - len(state.table), 0)

    # -- prefix cache ----------------------------------------------------------------------------

    def mark_computed(self, seq: Sequence) -> None:
        """Publish every block that became full and computed since the last call."""
        if not self._caching:
            return
        state = self._seqs[seq.seq_id]
        num_full = min(seq.num_computed_tokens, state.num_slots) // self.block_size
        if num_full <= state.num_published:
            return
        chain = self._chain(seq, num_full)
        for i in range(state.num_published, num_full):
            self.allocator.insert(state.table[i], chain[i])
        state.num_published = num_full

    def _peek_hits(self, seq: Sequence) -> list[int]:
        """Block ids of the cached prefix, excluding the block holding the last token (its
        logits must be computed) so a shared cached block is never written."""
        if not self._caching:
            return []
        max_blocks = max(seq.num_tokens - 1, 0) // self.block_size
        if max_blocks == 0:
            return []
        chain = self._chain(seq, max_blocks)
        hits = []
        for i in range(max_blocks):
            block_id = self.allocator.peek(chain[i])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _chain(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The first `num_blocks` chained block hashes of `seq`, extending the cached chain."""
        chain = self._chains.get(seq)
        if chain is None:
            chain = self._chains[seq] = []
        bs, tokens = self.block_size, seq.token_ids
        for i in range(len(chain), num_blocks):
            # The salt keys the first block only; chaining carries it to every later one.
            parent, salt = (chain[-1], None) if chain else (None, seq.request.cache_salt)
            chain.append(block_hash(parent, tokens[i * bs : (i + 1) * bs], salt))
        return chain

    # -- lifetime --------------------------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        if child.seq_id in self._seqs:
            raise ValueError(f"sequence {child.seq_id} already has blocks")
        state = self._seqs[parent.seq_id]
        for block_id in state.table:
            self.allocator.incref(block_id)
        self._seqs[child.seq_id] = _SeqBlocks(list(state.table), state.num_slots, state.num_published)
        chain = self._chains.get(parent)
        if chain is not None:
            self._chains[child] = list(chain)

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks, last first, so its deepest cached blocks are evicted first."""
        state = self._seqs.pop(seq.seq_id, None)
        if state is None:
            raise KeyError(f"sequence {seq.seq_id} has no blocks to free")
        alloc = self.allocator
        for block_id in reversed(state.table):
            alloc.free(block_id)
            if alloc.refcount(block_id) == 0:
                self._slots_used -= self._fill[block_id]
                self._fill[block_id] = 0

    def block_table(self, seq: Sequence) -> list[int]:
        return self._seqs[seq.seq_id].table

    def has_blocks(self, seq: Sequence) -> bool:
        return seq.seq_id in self._seqs

    def stats(self) -> KVStats:
        num_free = self.allocator.num_free_blocks
        return KVStats(
            num_total_blocks=self.num_total_blocks,
            num_allocated_blocks=self.num_total_blocks - num_free,
            num_free_blocks=num_free,
            num_cached_free_blocks=self.allocator.num_cached_free_blocks,
            num_token_slots_used=self._slots_used,
            block_size=self.block_size,
            num_queried_tokens=self.num_queried_tokens,
            num_hit_tokens=self.num_hit_tokens,
        )

    def _cdiv(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
