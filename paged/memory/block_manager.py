"""Maps sequences to KV blocks: admission, growth, copy-on-write, sliding-window recycling and the memory breakdown.
Prefix lookups (`PrefixIndex`), swap to a CPU pool (`SwapSpace`) and the per-block slot counts (`SlotLedger`) are
the classes it delegates to."""

from __future__ import annotations

from paged.memory.allocator import BlockAllocator, NoFreeBlocksError, plain_blocks
from paged.memory.block_swap import SwapMixin
from paged.memory.kv_accounting import AccountingMixin
from paged.memory.kv_tiers import KVTiers
from paged.memory.prefix_index import PrefixIndex
from paged.memory.reservation import ExactReservation, Reservation, final_length
from paged.memory.seq_blocks import AllocStatus, _SeqBlocks
from paged.memory.slot_ledger import SlotLedger
from paged.memory.swap_space import SwapSpace
from paged.request import Request, Sequence


class BlockManager(SwapMixin, AccountingMixin):
    """The scheduler's view of KV memory; the allocator below it only knows block ids.

    Contract with the caller: after `allocate` returns h, the caller sets `seq.num_computed_tokens = h`; after a
    step writes KV it advances `num_computed_tokens` and calls `mark_computed`. Writes only ever go to positions >=
    `num_computed_tokens`, which is what `append_slots` makes private (copy-on-write) before a step.

    How many slots a table covers beyond the tokens (none for paged allocation) is the `reservation`'s decision, at
    admission and before each growth step. With `num_cpu_blocks`, a sequence can be swapped out to a CPU pool and
    back (`swap_out` / `swap_in` return the block pairs the executor moves). With a `sliding_window`, blocks wholly
    before every future query's window are freed as the sequence grows. `max_model_len` caps the length a
    reservation counts on. `share_blocks=False` is the no-sharing baseline of the paper's sharing study: a forked
    sequence (or a prefix-cache hit) copies every block it shares before its next step. With `tiers`, evicted prefix
    blocks go to a CPU (and disk) tier and come back as hits by copy (`paged.memory.kv_tiers`).
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        watermark: float = 0.01,
        reservation: Reservation | None = None,
        *,
        max_model_len: int | None = None,
        num_cpu_blocks: int = 0,
        sliding_window: int | None = None,
        share_blocks: bool = True,
        tiers: KVTiers | None = None,
    ) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window!r}")
        self.allocator = allocator
        # the base class's `allocate_blocks` and `can_allocate_blocks`: a block's edge takes `allocate()` directly
        self._plain_blocks = plain_blocks(allocator)
        self.reservation = reservation or ExactReservation()
        self.max_model_len = max_model_len
        # False: the no-sharing baseline; a sequence copies every block it shares before its next step
        self.share_blocks = share_blocks
        # A contiguous extent is the reservation itself: it is kept whole until the sequence ends.
        self.sliding_window = None if allocator.contiguous else sliding_window
        self.block_size = allocator.block_size
        self.num_total_blocks = allocator.num_blocks
        self.watermark_blocks = int(watermark * self.num_total_blocks)
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.prefix_index = PrefixIndex(allocator, tiers)
        self.swap_space = SwapSpace(allocator, num_cpu_blocks)
        self.cpu_allocator = self.swap_space.allocator  # None without a CPU pool
        self.ledger = SlotLedger(self.num_total_blocks, self.block_size)
        self._seqs: dict[int, _SeqBlocks] = {}
        # live table entries over all sequences (`KVStats.num_logical_blocks`), kept as tables change
        # rather than summed over every sequence at each step's stats
        self._num_logical_blocks = 0

    # -- admission -------------------------------------------------------------------------------

    def rejection(self, request: Request) -> str | None:
        """Why `request` can never be served by this manager (it is then aborted); None if it can."""
        reason = self.reservation.rejection(request)
        params = request.params
        if reason is None and self.allocator.contiguous and params.best_of > 1:
            width = params.best_of
            what = f"beams (width {width})" if params.use_beam_search else f"samples (best_of={width})"
            reason = (
                f"{type(self.allocator).__name__} gives each sequence its own contiguous extent and cannot "
                f"share blocks between {what}; use a paged allocator (naive, prefix)"
            )
        return reason

    def can_allocate(self, *seqs: Sequence) -> AllocStatus:
        """Whether `seqs` (one sequence, or a request's sequences admitted together) fit now."""
        required = sum(map(self.admission_blocks, seqs))
        if self._never_fits(required):
            return AllocStatus.NEVER
        num_from_free = num_fresh = required
        for seq in seqs:
            hits = self.prefix_index.lookup(seq)
            # Reviving a cached-free block takes it out of the free pool just like a fresh one.
            num_from_free -= sum(1 for b in hits if self.allocator.refcount(b) > 0)
            num_fresh -= len(hits)
        return self._status(num_from_free, num_fresh)

    def _never_fits(self, num_blocks: int) -> bool:
        return num_blocks > self.allocator.max_allocation or self.num_total_blocks - num_blocks < self.watermark_blocks

    def _status(self, num_from_free: int, num_fresh: int) -> AllocStatus:
        """OK when taking `num_from_free` blocks from the free pool leaves the watermark, and the
        allocator can hand out `num_fresh` new ones at once (contiguously, if it must)."""
        alloc = self.allocator
        if alloc.num_free_blocks - num_from_free >= self.watermark_blocks and alloc.can_allocate_blocks(num_fresh):
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq: Sequence) -> int:
        """Build `seq`'s block table for all its tokens; returns how many are already computed."""
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence {seq.seq_id} already has blocks")
        bs, alloc, index = self.block_size, self.allocator, self.prefix_index
        num_tokens = seq.num_tokens
        required = self.admission_blocks(seq)
        hits = index.lookup(seq)
        needed = required - sum(1 for b in hits if alloc.refcount(b) > 0)
        if needed > alloc.num_free_blocks or not alloc.can_allocate_blocks(required - len(hits)):
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {needed} new blocks, {alloc.num_free_blocks} are free"
            )
        num_held = index.match(seq, hits)  # and the tier hits after them, kept through the evictions below
        for block_id in hits:
            if alloc.refcount(block_id) == 1:  # revived from the free pool: its slots count again
                self.ledger.account(block_id, bs, 0)
        table = list(hits)
        final = self._final(seq)
        if required > len(hits):
            table.extend(alloc.allocate_blocks(required - len(hits)))
        num_hits = len(hits) + index.onload(seq, table, len(hits), num_held)
        self.ledger.account_table(table, range(len(hits), required), num_tokens, final)
        state = self._seqs[seq.seq_id] = _SeqBlocks(table, num_tokens, final, num_hits)
        self._num_logical_blocks += len(table)
        num_hit_tokens = num_hits * bs
        if index.enabled:
            state.num_announced = index.announce(seq, state.num_published)
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens
        return num_hit_tokens

    def admission_blocks(self, seq: Sequence) -> int:
        """Blocks `seq`'s table covers once admitted: its tokens, or what the reservation asks."""
        return self._cdiv(max(seq.num_tokens, self.reservation.admission_slots(seq)))

    # -- growth ----------------------------------------------------------------------------------

    def can_append_slots(self, *seqs: Sequence) -> bool:
        """Whether every one of `seqs` can grow now. For sequences sharing a block each copy is
        counted, though the last holder writes in place: a group is judged conservatively."""
        num_new = num_copies = 0
        for seq in seqs:
            state = self._seqs[seq.seq_id]
            num_new += self._growth_blocks(seq, state)
            num_copies += len(self._shared_write_targets(seq, state))
        alloc = self.allocator
        return num_new + num_copies <= alloc.num_free_blocks and alloc.can_allocate_blocks(num_new)

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
        if self.sliding_window is not None:
            self._drop_outside_window(seq, state)
        table, bs, alloc = state.table, self.block_size, self.allocator
        num_tokens = len(seq.token_ids)
        last = state.num_slots
        if (
            self.share_blocks and num_tokens - 1 == last == seq.num_computed_tokens and last % bs
            and alloc.refcount(table[last // bs]) == 1 and self.reservation.growth_slots(seq) <= len(table) * bs
        ):
            # the common decode step: one token into a private block that has room
            self.ledger.append_token(table[last // bs])
            state.num_slots = num_tokens
            return []
        shared = self._shared_write_targets(seq, state)
        num_new = self._growth_blocks(seq, state)
        if num_new + len(shared) > alloc.num_free_blocks or not alloc.can_allocate_blocks(num_new):
            return None
        copies = []
        for i in shared:
            src = table[i]
            dst = alloc.allocate()
            alloc.free(src)
            table[i] = dst
            self.ledger.copy(src, dst, i, state.final)
            copies.append((src, dst))
        first_new = len(table)
        if num_new:
            table.extend(alloc.allocate_blocks(num_new))
            self._num_logical_blocks += num_new
        # Only the old last block and those after it gain filled slots; new blocks start their books.
        grown = range(max(max(state.num_slots - 1, 0) // bs, state.num_dropped), min(self._cdiv(num_tokens), first_new))
        self.ledger.account_table(table, (*grown, *range(first_new, len(table))), num_tokens, state.final)
        state.num_slots = num_tokens
        return copies

    def grow_decodes(self, seqs: list[Sequence], blocks: list[_SeqBlocks]) -> tuple[int, list[tuple[int, int]]]:
        """`try_append_slots` for each of `seqs` (with `blocks`, their `seq_blocks`) in order while
        each has exactly one token to compute and gets its slot: how many grew, and their
        copy-on-write copies. The first one that did not is left as it was (the scheduler's general
        path takes it from there). The steady decode step, one pass over the batch: a token into a
        private block with room costs no call, nor does one at a block's edge that opens a block."""
        alloc, ledger = self.allocator, self.ledger
        bs, refcount = self.block_size, alloc.refcount
        # the common path's test is `try_append_slots`' own, whose reservation check exact reservation passes
        common = self.share_blocks and self.sliding_window is None and type(self.reservation) is ExactReservation
        filled: list[int] = []
        copies: list[tuple[int, int]] = []
        grown = 0
        for seq, state in zip(seqs, blocks, strict=True):
            last = state.num_slots
            num_tokens = len(seq.token_ids)
            if num_tokens - 1 != seq.num_computed_tokens:
                break
            if common and last == num_tokens - 1 and last % bs and refcount(block := state.table[last // bs]) == 1:
                filled.append(block)
                state.num_slots = num_tokens
            elif common and last == num_tokens - 1 and last == len(state.table) * bs and self._can_open():
                # at a block's edge with a full table (all of a batch's rows at once when their lengths agree)
                self._open_block(state, num_tokens)
            elif (grew := self.try_append_slots(seq)) is not None:
                copies += grew
            else:
                break
            grown += 1
        ledger.append_each(filled)
        return grown, copies

    def open_block(self, seq: Sequence) -> bool:
        """`try_append_slots` of a decode step at a block's edge with a full table (exact
        reservation, no sliding window, a free block), as `grow_decodes` takes it; False where the
        step is not that one (nothing changed)."""
        state, num_tokens = self._seqs[seq.seq_id], len(seq.token_ids)
        if (self.share_blocks and self.sliding_window is None and type(self.reservation) is ExactReservation
                and state.num_slots == num_tokens - 1 == seq.num_computed_tokens == len(state.table) * self.block_size
                and self._can_open()):
            self._open_block(state, num_tokens)
            return True
        return False

    def _can_open(self) -> bool:
        """Whether one block can be allocated now (`can_allocate_blocks(1)`, by the free count alone
        where the allocator's is the base class's)."""
        alloc = self.allocator
        return bool(alloc.num_free_blocks) and (self._plain_blocks or alloc.can_allocate_blocks(1))

    def _open_block(self, state: _SeqBlocks, num_tokens: int) -> None:
        """One new private block, its first slot filled; the full block before it keeps its books
        (filled, nothing reserved), so only the new one is accounted (`account_table`'s numbers)."""
        table, alloc = state.table, self.allocator
        # `allocate_blocks(1)` after `_can_open`: the base class's is `[allocate()]`
        table.append(alloc.allocate() if self._plain_blocks else alloc.allocate_blocks(1)[0])
        self._num_logical_blocks += 1
        self.ledger.open_block(table[-1], len(table) - 1, state.final)
        state.num_slots = num_tokens

    def _shared_write_targets(self, seq: Sequence, state: _SeqBlocks) -> list[int]:
        """Indices of existing blocks that this step writes into but other tables also hold."""
        refcount, table, bs = self.allocator.refcount, state.table, self.block_size
        if not self.share_blocks:
            return [i for i in range(state.num_dropped, len(table)) if refcount(table[i]) > 1]
        first = seq.num_computed_tokens // bs
        last = min(-(-len(seq.token_ids) // bs), len(table))
        if last - first == 1:  # a decode step writes one block
            return [first] if refcount(table[first]) > 1 else []
        return [i for i in range(first, last) if refcount(table[i]) > 1]

    def _growth_blocks(self, seq: Sequence, state: _SeqBlocks) -> int:
        """Blocks to add to the table before the step that grows `seq` to `seq.num_tokens`."""
        covered = max(len(seq.token_ids), self.reservation.growth_slots(seq))
        return max(-(-covered // self.block_size) - len(state.table), 0)

    def _drop_outside_window(self, seq: Sequence, state: _SeqBlocks) -> None:
        """Free the blocks whose every position is before the window of the step's first query
        (position `num_computed_tokens`): no later query attends to them (vLLM V0's
        block_sliding_window)."""
        assert self.sliding_window is not None
        dead = min((seq.num_computed_tokens - self.sliding_window + 1) // self.block_size, len(state.table))
        for i in range(state.num_dropped, dead):
            self._release(state.table[i])
        if dead > state.num_dropped:
            self._num_logical_blocks -= dead - state.num_dropped
            state.num_dropped = dead

    def _final(self, seq: Sequence) -> int:
        """Slots `seq` fills before it ends: its last token is sampled but never written."""
        return final_length(seq.request, self.max_model_len) - 1

    def _release(self, block_id: int) -> None:
        """Drop one reference; a block nobody holds any more has no token states left."""
        self.allocator.free(block_id)
        if self.allocator.refcount(block_id) == 0:
            self.ledger.clear(block_id)

    # -- prefix cache ----------------------------------------------------------------------------

    def mark_computed(self, seq: Sequence) -> None:
        """Publish every block that became full and computed since the last call."""
        index = self.prefix_index
        if not index.enabled:
            return
        state = self._seqs[seq.seq_id]
        num_full = min(seq.num_computed_tokens, state.num_slots) // self.block_size
        if num_full <= state.num_published:
            return
        index.publish(seq, state.table, max(state.num_published, state.num_dropped), num_full)
        # announced are the blocks full at admission; one filled since has nothing to withdraw
        if state.num_announced > state.num_published:
            index.withdraw(seq, state.num_published, min(num_full, state.num_announced))
        state.num_published = num_full

    def awaits_prefix(self, seq: Sequence) -> bool:
        """Whether `seq`, admitted a step later, would hit a block now being computed (`PrefixIndex.awaits`)."""
        return self.prefix_index.awaits(seq)

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq`'s prompt the prefix cache and its tiers hold now (what admitting it would skip)."""
        return self.prefix_index.num_hit_blocks(seq) * self.block_size

    # -- lifetime --------------------------------------------------------------------------------

    def fork(self, parent: Sequence, child: Sequence) -> None:
        if child.seq_id in self._seqs:
            raise ValueError(f"sequence {child.seq_id} already has blocks")
        state = self._seqs[parent.seq_id]
        for block_id in state.table[state.num_dropped :]:
            self.allocator.incref(block_id)
        self._seqs[child.seq_id] = _SeqBlocks(
            list(state.table), state.num_slots, state.final, state.num_published, state.num_dropped
        )
        self._num_logical_blocks += len(state.table) - state.num_dropped
        self.prefix_index.fork(parent, child)

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks (device or swapped-out), last first, so its deepest cached blocks
        are evicted first."""
        if self.swap_space.free(seq):
            return
        state = self._seqs.pop(seq.seq_id, None)
        if state is None:
            raise KeyError(f"sequence {seq.seq_id} has no blocks to free")
        self._num_logical_blocks -= len(state.table) - state.num_dropped
        if state.num_announced > state.num_published:
            self.prefix_index.withdraw(seq, state.num_published, state.num_announced)
        alloc_free, refcount, clear = self.allocator.free, self.allocator.refcount, self.ledger.clear
        for block_id in reversed(state.table[state.num_dropped :]):  # `_release` of each, its calls bound once
            alloc_free(block_id)
            if not refcount(block_id):
                clear(block_id)
        if seq.is_finished:  # a preempted sequence keeps its chain for its readmission
            self.prefix_index.forget(seq)

    def block_table(self, seq: Sequence) -> list[int]:
        return self._seqs[seq.seq_id].table

    def seq_blocks(self, seq: Sequence) -> _SeqBlocks:
        """`seq`'s table and slot counts, which fast-forward's decode steps fill (`paged.engine.fast_forward`)."""
        return self._seqs[seq.seq_id]

    def has_blocks(self, seq: Sequence) -> bool:
        """Whether `seq` holds blocks, on the device or swapped out."""
        return seq.seq_id in self._seqs or self.swap_space.holds(seq)

    def _cdiv(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
