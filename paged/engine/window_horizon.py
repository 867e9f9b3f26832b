"""What a planned fast-forward window tells a reader before its steps run: how long at least until
the engine's next step that is not one of them, and whether what a router reads of the prefix
cache can change in them.

A fleet replica lags behind the fleet's clock while it is inside a window (`Fleet`): its window
steps run only when something needs them (a request routed to it, a read that the window could
change, its window's end). For that the fleet needs a lower bound of the window's end in time
(`horizon`: the steps left times a lower bound of any step's cost) and, at an arrival, whether
the steps that would have run by then could change the prefix match the router asks for
(`prefix_unchanged`): they change the cache only by evicting free cached blocks for their growth
and by publishing the blocks their rows fill. Both answers are conservative: where they cannot
tell, the replica runs its steps up to the arrival first, as stepping would have.
"""

from __future__ import annotations

from paged.engine.window_steps import Window
from paged.memory import BlockManager
from paged.memory.prefix import PrefixCachingAllocator
from paged.sim.executor import LENGTH_MUL, SAMPLE_MUL, TOKEN_MUL


def steps_left(window: Window, vocab: int) -> int:
    """The window's steps not yet run: to its planned last step, or to the step before the first
    whose token would stop a row (the stop is found once, by `plain_token`'s recurrence, as
    `window_steps._tokens` finds it)."""
    if window.stop_at is None:
        window.stop_at = window.done + _first_stop(window, vocab, window.limit - window.done)
    return min(window.limit, window.stop_at) - window.done


def _first_stop(window: Window, vocab: int, k: int) -> int:
    """The first of the next `k` steps whose token would stop a row; `k` when none would."""
    for r in window.order:
        row = window.rows[r]
        if not row.stops:
            break  # `order` puts the rows that can stop first
        last, length, salt = row.token_ids[-1], window.contexts[r], SAMPLE_MUL * row.sample
        for j in range(k):
            last = (last * TOKEN_MUL + (length + j) * LENGTH_MUL + salt) % vocab
            if last in row.stops and length + j >= row.stop_from:
                k = j
                break
    return k


def evicts(bm: BlockManager, new_blocks: int) -> bool:
    """Whether taking `new_blocks` fresh blocks could evict a cached one: the prefix-caching
    allocator hands out never-hashed free blocks first, and evicts only once they are gone."""
    allocator = bm.allocator
    if not isinstance(allocator, PrefixCachingAllocator):
        return bm.prefix_index.enabled
    return new_blocks > allocator.num_free_blocks - allocator.num_cached_free_blocks


def prefix_unchanged(window: Window, bm: BlockManager, chain: list[bytes], matched: int) -> bool:
    """Whether the window's steps leave `cached_blocks(chain)` at `matched`, what it is now: none of
    the matched blocks can be evicted (each is in use, or the window evicts nothing), and no row can
    publish the block after them (a row publishes a block at its own position only, so it must not
    have published that position yet and its tokens must agree with the chain's so far)."""
    index = bm.prefix_index
    if not index.enabled or index.tiers is not None:
        return not index.enabled
    allocator = bm.allocator
    if window.evicts:
        for h in chain[:matched]:
            block = allocator.peek(h)
            if block is None or allocator.refcount(block) == 0:
                return False
    if matched == len(chain):
        return True
    bs = bm.block_size
    for row in window.rows:
        if row.blocks.num_published > matched:
            continue
        known = min(len(row.token_ids) // bs, matched + 1)  # full blocks now, up to the chain's next
        if known == 0 or index.chain(row.seq, known)[-1] == chain[known - 1]:
            return False
    return True
