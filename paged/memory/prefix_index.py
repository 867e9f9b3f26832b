"""The prefix index: a sequence's chained block hashes, looked up in and published to the allocator's
prefix cache, and the registry of full blocks admitted sequences are computing right now.

The allocator's cache maps a block hash to a block id and knows nothing of sequences; this index
hashes a sequence's tokens block by block and walks the cache along that chain (vLLM V1's
`KVCacheManager.get_computed_blocks` and `BlockPool.cache_full_blocks`). The computing registry is
what the scheduler's prefix de-duplication asks: a waiting request whose next block another request
is computing this step can wait one step and hit it instead of computing it again.

With tiers for evicted prefixes (`KVTiers`), a lookup continues along the chain into the tiers where
the device misses (`lower_hits`), and admission brings those blocks back by copy (`hold`, `onload`).
"""

from __future__ import annotations

import weakref
from collections import Counter

from paged.memory.allocator import BlockAllocator
from paged.memory.hashing import extend_chain, request_block_hashes
from paged.memory.kv_tiers import BlockPairs, KVTiers
from paged.memory.prefix import PrefixCachingAllocator
from paged.request import Sequence


class PrefixIndex:
    """Sequences' hash chains over the allocator's prefix cache.

    With an allocator that caches nothing (`enabled` False) every lookup misses and publishing does
    nothing; the block manager then announces nothing either.
    """

    def __init__(self, allocator: BlockAllocator, tiers: KVTiers | None = None) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.enabled = allocator.caches_prefixes
        # `allocator.peek`, as the cache map's `get` where the allocator is the plain prefix-caching one
        # (a KV group's view of a shared pool keys its hashes first)
        self._peek = allocator.peeker() if type(allocator) is PrefixCachingAllocator else allocator.peek
        self.tiers = tiers if self.enabled else None
        if self.tiers is not None:
            allocator.on_evict = self._evicted  # type: ignore[attr-defined]  # a PrefixCachingAllocator's hook
        # Cached per Sequence object (weakly, so aborted waiting sequences don't leak): admission
        # re-asks every step while a sequence waits, and a chain survives preemption.
        self._chains: weakref.WeakKeyDictionary[Sequence, list[bytes]] = weakref.WeakKeyDictionary()
        # hashes of full blocks an admitted sequence is still computing, and how many such holders
        self.computing: Counter[bytes] = Counter()

    def lookup(self, seq: Sequence) -> list[int]:
        """Block ids of `seq`'s cached prefix, taking no reference (admission asks before it commits).
        The block holding the last token is never one: its logits must be computed, so a shared
        cached block is never written."""
        max_blocks = self._max_hit_blocks(seq)
        if max_blocks == 0:
            return []
        chain, peek = self._chain(seq, max_blocks), self._peek
        hits = []
        for i in range(max_blocks):
            block_id = peek(chain[i])
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _max_hit_blocks(self, seq: Sequence) -> int:
        """Blocks of `seq` a prefix hit may cover: none for prompt log-probabilities (every prompt
        position is computed), else every full block before the one holding the last token."""
        if not self.enabled or seq.request.params.prompt_logprobs is not None:
            return 0
        return max(seq.num_tokens - 1, 0) // self.block_size

    def lower_hits(self, seq: Sequence, start: int) -> int:
        """How many blocks of `seq`'s chain from `start` (its device hits) the tiers below the device
        hold: a lookup that goes on where the device missed, taking nothing."""
        if self.tiers is None:
            return 0
        max_blocks = self._max_hit_blocks(seq)
        chain = self._chain(seq, max_blocks)
        hits = 0
        for i in range(start, max_blocks):
            if not self.tiers.holds(chain[i]):
                break
            hits += 1
        return hits

    def num_hit_blocks(self, seq: Sequence) -> int:
        """Blocks of `seq`'s prompt the cache and the tiers below it hold now: what admission skips."""
        num_hits = len(self.lookup(seq))
        return num_hits + self.lower_hits(seq, num_hits)

    def hold(self, seq: Sequence, start: int) -> int:
        """Pin the blocks `lower_hits(seq, start)` finds in their tiers, so that the evictions of the
        allocation that follows keep them (a full tier evicts none of them); returns how many."""
        if self.tiers is None:
            return 0
        max_blocks = self._max_hit_blocks(seq)
        return self.tiers.hold(self._chain(seq, max_blocks)[start:])

    def onload(self, seq: Sequence, table: list[int], start: int, num_held: int) -> int:
        """Bring the `num_held` blocks `hold` pinned back into the fresh blocks `table[start:]` and
        cache them there under their hashes; returns how many came back (a missing or corrupt disk
        file ends the run of hits there)."""
        if not num_held:
            return 0
        assert self.tiers is not None
        chain = self._chain(seq, start + num_held)
        for i in range(start, start + num_held):
            if self.tiers.onload(chain[i], table[i]) is None:
                return i - start
            self.allocator.insert(table[i], chain[i], i)
        return num_held

    def take_tier_moves(self) -> tuple[BlockPairs, BlockPairs]:
        """The step's copies for the tiers below the device (`KVTiers.take_moves`), which the
        scheduler hands the executor; none without tiers."""
        return self.tiers.take_moves() if self.tiers is not None else ([], [])

    def tier_counts(self) -> dict[str, int]:
        """The tiers' counters as `KVStats` fields; none without tiers."""
        return self.tiers.counts(self.block_size) if self.tiers is not None else {}

    def _evicted(self, block_id: int, block_hash: bytes) -> None:
        """The allocator's eviction hook: the tiers keep the block."""
        assert self.tiers is not None
        self.tiers.offload(block_id, block_hash, self.allocator.position(block_id))  # type: ignore[attr-defined]

    def cached_blocks(self, chain: list[bytes]) -> int:
        """How many blocks from the start of `chain` (a prompt's `prompt_block_hashes`) the cache
        (and the tiers below it) hold now: what a router asks of a replica, without a sequence and
        taking no reference."""
        if not self.enabled:
            return 0
        hits, peek = 0, self._peek
        for h in chain:
            if peek(h) is None:
                break
            hits += 1
        while self.tiers is not None and hits < len(chain) and self.tiers.holds(chain[hits]):
            hits += 1
        return hits

    def match(self, seq: Sequence, hits: list[int]) -> int:
        """Take a reference on each of `hits`, what `lookup(seq)` just returned, and pin the blocks
        the tiers hold after them (`hold`); returns how many `onload` may then bring back."""
        chain = self._chains.get(seq, ())
        for i, expected in enumerate(hits):
            block_id = self.allocator.match(chain[i])
            assert block_id == expected, "prefix cache changed between lookup and match"
        return self.hold(seq, len(hits))

    def publish(self, seq: Sequence, table: list[int], start: int, stop: int) -> None:
        """Insert `table[start:stop]`, full blocks `seq` has computed, into the cache."""
        chain = self._chain(seq, stop)
        for i in range(start, stop):
            self.allocator.insert(table[i], chain[i], i)

    def announce(self, seq: Sequence, start: int) -> int:
        """Register the full blocks of `seq` from `start` on as being computed, so `awaits` sees
        them; returns the index after the last one announced."""
        num_full = seq.num_tokens // self.block_size
        chain = self._chain(seq, num_full)
        for i in range(start, num_full):
            self.computing[chain[i]] += 1
        return max(num_full, start)

    def withdraw(self, seq: Sequence, start: int, stop: int) -> None:
        """Unregister `seq`'s announced blocks `start:stop`: published, or never to be (freed)."""
        chain = self._chain(seq, stop)
        for i in range(start, stop):
            block_hash = chain[i]
            if self.computing[block_hash] <= 1:
                del self.computing[block_hash]
            else:
                self.computing[block_hash] -= 1

    def awaits(self, seq: Sequence) -> bool:
        """Whether the first block of `seq` the cache misses is one an admitted sequence is computing
        now: admitted a step later, `seq` would hit it instead of computing it again."""
        if not self.computing or seq.request.params.prompt_logprobs is not None:
            return False
        num_hits = len(self.lookup(seq))
        if (num_hits + 1) * self.block_size > seq.num_tokens - 1:  # no further block could be a hit
            return False
        return self._chain(seq, num_hits + 1)[num_hits] in self.computing

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` starts as a copy of `parent`'s tokens, so of its chain."""
        chain = self._chains.get(parent)
        if chain is not None:
            self._chains[child] = list(chain)

    def forget(self, seq: Sequence) -> None:
        """`seq` finished: it is never admitted again, so its chain goes now rather than with the
        sequence (a finished request keeps its sequences: a fleet hour's chains were 400 MB), and
        its request's prompt chain with it (a later sequence of the request would hash it again)."""
        self._chains.pop(seq, None)
        seq.request.prompt_hashes = None

    def chain(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The first `num_blocks` chained block hashes of `seq` (its full blocks' tokens)."""
        return self._chain(seq, num_blocks)[:num_blocks]

    def _chain(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The first `num_blocks` chained block hashes of `seq`, extending the cached chain. A new
        chain starts as its request's prompt chain (`request_block_hashes`, which a router may have
        computed already): every sequence of a request starts with its prompt."""
        chain = self._chains.get(seq)
        if chain is None:
            request = seq.request
            prompt = request_block_hashes(request, self.block_size) if num_blocks else []
            chain = self._chains[seq] = prompt[:num_blocks]
        if num_blocks > len(chain):
            extend_chain(chain, seq.token_ids, self.block_size, num_blocks, seq.request.cache_salt)
        return chain
