"""The prefix index: a sequence's chained block hashes, looked up in and published to the allocator's
prefix cache, and the registry of full blocks admitted sequences are computing right now.

The allocator's cache maps a block hash to a block id and knows nothing of sequences; this index
hashes a sequence's tokens block by block and walks the cache along that chain (vLLM V1's
`KVCacheManager.get_computed_blocks` and `BlockPool.cache_full_blocks`). The computing registry is
what the scheduler's prefix de-duplication asks: a waiting request whose next block another request
is computing this step can wait one step and hit it instead of computing it again.
"""

from __future__ import annotations

import weakref
from collections import Counter

from paged.memory.allocator import BlockAllocator
from paged.memory.hashing import block_hash
from paged.request import Sequence


class PrefixIndex:
    """Sequences' hash chains over the allocator's prefix cache.

    With an allocator that caches nothing (`enabled` False) every lookup misses and publishing does
    nothing; the block manager then announces nothing either.
    """

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.enabled = allocator.caches_prefixes
        # Cached per Sequence object (weakly, so aborted waiting sequences don't leak): admission
        # re-asks every step while a sequence waits, and a chain survives preemption.
        self._chains: weakref.WeakKeyDictionary[Sequence, list[bytes]] = weakref.WeakKeyDictionary()
        # hashes of full blocks an admitted sequence is still computing, and how many such holders
        self.computing: Counter[bytes] = Counter()

    def lookup(self, seq: Sequence) -> list[int]:
        """Block ids of `seq`'s cached prefix, taking no reference (admission asks before it commits).
        The block holding the last token is never one: its logits must be computed, so a shared
        cached block is never written."""
        # prompt log-probabilities need every prompt position computed
        if not self.enabled or seq.request.params.prompt_logprobs is not None:
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

    def cached_blocks(self, chain: list[bytes]) -> int:
        """How many blocks from the start of `chain` (a prompt's `prompt_block_hashes`) the cache
        holds now: what a router asks of a replica, without a sequence and taking no reference."""
        if not self.enabled:
            return 0
        hits = 0
        for h in chain:
            if self.allocator.peek(h) is None:
                break
            hits += 1
        return hits

    def match(self, seq: Sequence, hits: list[int]) -> None:
        """Take a reference on each of `hits`, what `lookup(seq)` just returned."""
        chain = self._chains.get(seq, ())
        for i, expected in enumerate(hits):
            block_id = self.allocator.match(chain[i])
            assert block_id == expected, "prefix cache changed between lookup and match"

    def publish(self, seq: Sequence, table: list[int], start: int, stop: int) -> None:
        """Insert `table[start:stop]`, full blocks `seq` has computed, into the cache."""
        chain = self._chain(seq, stop)
        for i in range(start, stop):
            self.allocator.insert(table[i], chain[i])

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
