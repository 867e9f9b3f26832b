"""Maps sequences to KV blocks: admission, growth, copy-on-write, prefix reuse, swap to a CPU pool,
sliding-window recycling and the memory breakdown."""

from __future__ import annotations

import enum
import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from paged.memory.allocator import BlockAllocator, NoFreeBlocksError
from paged.memory.hashing import block_hash
from paged.memory.naive import NaiveAllocator
from paged.memory.reservation import ExactReservation, Reservation, final_length
from paged.request import Request, Sequence
from paged.step import KVStats


class AllocStatus(enum.Enum):
    OK = "ok"
    LATER = "later"
    NEVER = "never"


@dataclass(slots=True)
class _SeqBlocks:
    table: list[int]
    num_slots: int  # token slots filled, i.e. seq.num_tokens at the last allocate/append
    final: int  # slots the sequence fills before its length limit: what its reservation is for
    num_published: int = 0  # leading blocks already inserted into the prefix cache
    # Leading blocks freed because they lie wholly before the sliding window; their table entries
    # are stale ids that the attention kernels never read.
    num_dropped: int = 0
    # Leading blocks whose hashes were announced as being computed (from `num_published` on, until
    # published or freed): what waiting requests with the same prefix can wait for.
    num_announced: int = 0


@dataclass(slots=True)
class _Swapped:
    cpu_blocks: list[int]  # CPU copies of table[num_dropped : num_dropped + len(cpu_blocks)]
    stale: list[int]  # the dropped leading entries, kept so logical block indices stay put


class BlockManager:
    """The scheduler's view of KV memory; the allocator below it only knows block ids.

    Contract with the caller: after `allocate` returns h, the caller sets
    `seq.num_computed_tokens = h`; after a step writes KV it advances `num_computed_tokens` and
    calls `mark_computed`. Writes only ever go to positions >= `num_computed_tokens`, which is
    what `append_slots` makes private (copy-on-write) before a step.

    How many slots a table covers beyond the tokens (none for paged allocation) is the
    `reservation`'s decision, at admission and before each growth step. With `num_cpu_blocks`, a
    sequence can be swapped out to a CPU pool and back (`swap_out` / `swap_in` return the block
    pairs the executor moves). With a `sliding_window`, blocks wholly before every future query's
    window are freed as the sequence grows. `max_model_len` caps the length a reservation counts on.
    `share_blocks=False` is the no-sharing baseline of the paper's sharing study: a forked sequence
    (or a prefix-cache hit) copies every block it shares before its next step.
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
    ) -> None:
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window!r}")
        self.allocator = allocator
        self.reservation = reservation or ExactReservation()
        self.max_model_len = max_model_len
        # False: the no-sharing baseline; a sequence copies every block it shares before its next step
        self.share_blocks = share_blocks
        # A contiguous extent is the reservation itself: it is kept whole until the sequence ends.
        self.sliding_window = None if allocator.contiguous else sliding_window
        self.cpu_allocator = NaiveAllocator(num_cpu_blocks, allocator.block_size) if num_cpu_blocks else None
        self._swapped: dict[int, _Swapped] = {}
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
        # hashes of full blocks an admitted sequence is still computing, and how many such holders
        self._computing: Counter[bytes] = Counter()
        # Filled slots per physical block. A shared block is never written (CoW first), so every
        # sequence referencing it agrees on its fill; summing once per block counts token states.
        self._fill = [0] * self.num_total_blocks
        self._slots_used = 0
        # Per block, the empty slots its sequence will still fill (the same bookkeeping as `_fill`).
        self._future = [0] * self.num_total_blocks
        self._reserved = 0

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
            hits = self._peek_hits(seq)
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
        bs, alloc = self.block_size, self.allocator
        num_tokens = seq.num_tokens
        required = self.admission_blocks(seq)
        hits = self._peek_hits(seq)
        needed = required - sum(1 for b in hits if alloc.refcount(b) > 0)
        if needed > alloc.num_free_blocks or not alloc.can_allocate_blocks(required - len(hits)):
            raise NoFreeBlocksError(
                f"sequence {seq.seq_id} needs {needed} new blocks, {alloc.num_free_blocks} are free"
            )
        table: list[int] = []
        chain = self._chains.get(seq, ())
        for i, expected in enumerate(hits):
            block_id = alloc.match(chain[i])
            assert block_id == expected, "prefix cache changed between peek and match"
            if alloc.refcount(block_id) == 1:
                self._account(block_id, bs, 0)
            table.append(block_id)
        final = self._final(seq)
        if required > len(hits):
            table.extend(alloc.allocate_blocks(required - len(hits)))
        self._account_blocks(table, range(len(hits), required), num_tokens, final)
        state = self._seqs[seq.seq_id] = _SeqBlocks(table, num_tokens, final, len(hits))
        num_hit_tokens = len(hits) * bs
        if self._caching:
            self._announce(seq, state)
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens
        return num_hit_tokens

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
            block_id = table[last // bs]
            self._fill[block_id] += 1
            self._slots_used += 1
            if self._future[block_id]:
                self._future[block_id] -= 1
                self._reserved -= 1
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
            self._account(dst, self._fill[src], self._cap(i, state.final))
            copies.append((src, dst))
        first_new = len(table)
        if num_new:
            table.extend(alloc.allocate_blocks(num_new))
        # Only the old last block and those after it gain filled slots; new blocks start their books.
        grown = range(max(max(state.num_slots - 1, 0) // bs, state.num_dropped), min(self._cdiv(num_tokens), first_new))
        self._account_blocks(table, (*grown, *range(first_new, len(table))), num_tokens, state.final)
        state.num_slots = num_tokens
        return copies

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

    def admission_blocks(self, seq: Sequence) -> int:
        """Blocks `seq`'s table covers once admitted: its tokens, or what the reservation asks."""
        return self._cdiv(max(seq.num_tokens, self.reservation.admission_slots(seq)))

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
        state.num_dropped = max(state.num_dropped, dead)

    # -- accounting ------------------------------------------------------------------------------

    def _final(self, seq: Sequence) -> int:
        """Slots `seq` fills before it ends: its last token is sampled but never written."""
        return final_length(seq.request, self.max_model_len) - 1

    def _cap(self, index: int, final: int) -> int:
        """Slots of the table's `index`-th block that a sequence filling `final` slots uses."""
        return min(max(final - index * self.block_size, 0), self.block_size)

    def _account(self, block_id: int, fill: int, cap: int) -> None:
        """Set a block's filled slots, and its reserved ones: the empty slots among the `cap` that
        its sequence will fill."""
        future = max(cap - fill, 0)
        self._slots_used += fill - self._fill[block_id]
        self._reserved += future - self._future[block_id]
        self._fill[block_id] = fill
        self._future[block_id] = future

    def _account_blocks(self, table: list[int], indices: Iterable[int], num_tokens: int, final: int) -> None:
        """`_account` the table's blocks at `indices` for a sequence of `num_tokens` filling `final` slots."""
        bs = self.block_size
        for i in indices:
            self._account(table[i], min(bs, max(num_tokens - i * bs, 0)), self._cap(i, final))

    def _release(self, block_id: int) -> None:
        """Drop one reference; a block nobody holds any more has no token states left."""
        self.allocator.free(block_id)
        if self.allocator.refcount(block_id) == 0:
            self._account(block_id, 0, 0)

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
        for i in range(max(state.num_published, state.num_dropped), num_full):
            self.allocator.insert(state.table[i], chain[i])
        self._withdraw(chain, state.num_published, min(num_full, state.num_announced))
        state.num_published = num_full

    def _announce(self, seq: Sequence, state: _SeqBlocks) -> None:
        """Record the full blocks `seq` is about to compute, so `awaits_prefix` sees them."""
        num_full = seq.num_tokens // self.block_size
        chain = self._chain(seq, num_full)
        for i in range(state.num_published, num_full):
            self._computing[chain[i]] += 1
        state.num_announced = max(num_full, state.num_published)

    def _withdraw(self, chain: list[bytes], start: int, stop: int) -> None:
        for i in range(start, stop):
            block_hash = chain[i]
            if self._computing[block_hash] <= 1:
                del self._computing[block_hash]
            else:
                self._computing[block_hash] -= 1

    def awaits_prefix(self, seq: Sequence) -> bool:
        """Whether the first block of `seq` the cache misses is one an admitted sequence is computing
        now: admitted a step later, `seq` would hit it instead of computing it again."""
        if not self._computing or seq.request.params.prompt_logprobs is not None:
            return False
        num_hits = len(self._peek_hits(seq))
        if (num_hits + 1) * self.block_size > seq.num_tokens - 1:  # no further block could be a hit
            return False
        return self._chain(seq, num_hits + 1)[num_hits] in self._computing

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of `seq`'s prompt the prefix cache holds now (what admitting it would skip)."""
        return len(self._peek_hits(seq)) * self.block_size

    def _peek_hits(self, seq: Sequence) -> list[int]:
        """Block ids of the cached prefix, excluding the block holding the last token (its
        logits must be computed) so a shared cached block is never written."""
        # prompt log-probabilities need every prompt position computed
        if not self._caching or seq.request.params.prompt_logprobs is not None:
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
        for block_id in state.table[state.num_dropped :]:
            self.allocator.incref(block_id)
        self._seqs[child.seq_id] = _SeqBlocks(
            list(state.table), state.num_slots, state.final, state.num_published, state.num_dropped
        )
        chain = self._chains.get(parent)
        if chain is not None:
            self._chains[child] = list(chain)

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks (device or swapped-out), last first, so its deepest cached blocks
        are evicted first."""
        swapped = self._swapped.pop(seq.seq_id, None)
        if swapped is not None:
            assert self.cpu_allocator is not None
            for block_id in swapped.cpu_blocks:
                self.cpu_allocator.free(block_id)
            return
        state = self._seqs.pop(seq.seq_id, None)
        if state is None:
            raise KeyError(f"sequence {seq.seq_id} has no blocks to free")
        if state.num_announced > state.num_published:
            self._withdraw(self._chains[seq], state.num_published, state.num_announced)
        for block_id in reversed(state.table[state.num_dropped :]):
            self._release(block_id)

    # -- swap ------------------------------------------------------------------------------------

    def can_swap_out(self, *seqs: Sequence) -> bool:
        """Whether the CPU pool can take the filled blocks of `seqs` (one request's running
        sequences: a block they share moves once) now."""
        if self.cpu_allocator is None:
            return False
        return len(self._distinct_filled_blocks(*seqs)) <= self.cpu_allocator.num_free_blocks

    def _distinct_filled_blocks(self, *seqs: Sequence) -> list[int]:
        return list(dict.fromkeys(b for s in seqs for b in self._filled_blocks(self._seqs[s.seq_id])))

    def swap_out(self, *seqs: Sequence) -> list[tuple[int, int]]:
        """Move the filled blocks of `seqs` to the CPU pool, keeping what they share shared, and free
        their device blocks; returns the (device block, CPU block) pairs to copy before the step."""
        if not self.can_swap_out(*seqs):
            raise NoFreeBlocksError(f"the CPU swap space cannot take sequences {[s.seq_id for s in seqs]}")
        cpu = self.cpu_allocator
        assert cpu is not None
        moved = self._distinct_filled_blocks(*seqs)
        to_cpu = dict(zip(moved, cpu.allocate_blocks(len(moved)), strict=True))
        for seq in seqs:
            state = self._seqs[seq.seq_id]
            cpu_blocks = [to_cpu[b] for b in self._filled_blocks(state)]
            for block_id in cpu_blocks:
                cpu.incref(block_id)
            self.free(seq)
            self._swapped[seq.seq_id] = _Swapped(cpu_blocks, state.table[: state.num_dropped])
        # every holder took its own reference above: drop the one allocation gave
        for block_id in to_cpu.values():
            cpu.free(block_id)
        return list(to_cpu.items())

    def _first_written(self, seq: Sequence) -> int:
        """Index, among `seq`'s swapped-out blocks, of the first one its next step writes: from there
        on each sequence gets its own device copy, so nothing shared is written."""
        return seq.num_computed_tokens // self.block_size - len(self._swapped[seq.seq_id].stale)

    def _swap_in_blocks(self, *seqs: Sequence) -> int:
        """Device blocks `seqs` need to come back: each shared CPU block once, each block a next
        step writes once per sequence, plus what reservations cover beyond the tokens."""
        shared: set[int] = set()
        num_blocks = 0
        for s in seqs:
            swapped = self._swapped[s.seq_id]
            first_written = self._first_written(s)
            shared.update(swapped.cpu_blocks[:first_written])
            num_blocks += self.admission_blocks(s) - len(swapped.stale) - min(first_written, len(swapped.cpu_blocks))
        return len(shared) + num_blocks

    def can_swap_in(self, *seqs: Sequence) -> AllocStatus:
        required = self._swap_in_blocks(*seqs)
        if self._never_fits(required):
            return AllocStatus.NEVER
        return self._status(required, required)

    def swap_in(self, *seqs: Sequence) -> list[tuple[int, int]]:
        """Give `seqs` device blocks for all their tokens (and reservations), sharing again what
        they shared and will only read, and bring their KV back; returns the (CPU block, device
        block) pairs to copy before the step runs (a CPU block may go to several device blocks)."""
        if self.can_swap_in(*seqs) is not AllocStatus.OK:
            raise NoFreeBlocksError(f"no room on the device to swap sequences {[s.seq_id for s in seqs]} in")
        cpu = self.cpu_allocator
        assert cpu is not None
        # one allocation, so a contiguous allocator gives a lone sequence one extent
        fresh = iter(self.allocator.allocate_blocks(self._swap_in_blocks(*seqs)))
        to_device: dict[int, int] = {}
        pairs: list[tuple[int, int]] = []
        for seq in seqs:
            first_written = self._first_written(seq)
            swapped = self._swapped.pop(seq.seq_id)
            start = len(swapped.stale)
            table = list(swapped.stale)
            for i, block_id in enumerate(swapped.cpu_blocks):
                device = to_device.get(block_id) if i < first_written else None
                if device is None:
                    device = next(fresh)
                    pairs.append((block_id, device))
                    if i < first_written:
                        to_device[block_id] = device
                else:
                    self.allocator.incref(device)
                table.append(device)
                cpu.free(block_id)
            table.extend(next(fresh) for _ in range(self.admission_blocks(seq) - len(table)))
            final = self._final(seq)
            self._account_blocks(table, range(start, len(table)), seq.num_tokens, final)
            # Swapped-in blocks are published again on the next mark_computed (a duplicate of a
            # block still cached stays unpublished).
            self._seqs[seq.seq_id] = _SeqBlocks(table, seq.num_tokens, final, start, start)
        return pairs

    def is_swapped(self, seq: Sequence) -> bool:
        return seq.seq_id in self._swapped

    def _filled_blocks(self, state: _SeqBlocks) -> list[int]:
        """The live blocks holding token states: what a swap moves (an empty reservation is not)."""
        return state.table[state.num_dropped : self._cdiv(state.num_slots)]

    def block_table(self, seq: Sequence) -> list[int]:
        return self._seqs[seq.seq_id].table

    def has_blocks(self, seq: Sequence) -> bool:
        """Whether `seq` holds blocks, on the device or swapped out."""
        return seq.seq_id in self._seqs or seq.seq_id in self._swapped

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
            num_token_slots_used=self._slots_used,
            block_size=self.block_size,
            num_queried_tokens=self.num_queried_tokens,
            num_hit_tokens=self.num_hit_tokens,
            num_reserved_slots=self._reserved,
            num_unassigned_blocks=self.allocator.num_unassigned_blocks,
            num_stranded_free_blocks=self.allocator.num_stranded_free_blocks(blocked_blocks) if blocked_blocks else 0,
            num_cpu_blocks=cpu.num_blocks if cpu else 0,
            num_free_cpu_blocks=cpu.num_free_blocks if cpu else 0,
            num_logical_blocks=sum(len(s.table) - s.num_dropped for s in self._seqs.values()),
        )

    def _cdiv(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
