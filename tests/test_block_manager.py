"""BlockManager: admission, growth, copy-on-write, prefix reuse and accounting."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged.memory import (
    AllocStatus,
    BlockAllocator,
    BlockManager,
    BuddyAllocator,
    NaiveAllocator,
    NoFreeBlocksError,
    PrefixCachingAllocator,
)
from paged.memory.allocator import plain_blocks
from paged.memory.reservation import MaxReservation
from paged.request import Request, SamplingParams, Sequence
from tests.hypothesis_budget import examples

ALLOCATORS = [NaiveAllocator, PrefixCachingAllocator]
# The random interleavings also run on the buddy allocator (exact reservation: a table grows one
# block at a time, each a one-block extent; admission takes the prompt's blocks as one extent).
MACHINE_ALLOCATORS = [*ALLOCATORS, BuddyAllocator]


def make_seq(tokens: list[int], salt: str | None = None) -> Sequence:
    return Request("r", tokens, SamplingParams(temperature=0.0), cache_salt=salt).seqs[0]


def run_prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit, compute the whole prompt and publish it, as one engine step would."""
    seq.num_computed_tokens = bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.mark_computed(seq)


def manager(cls=PrefixCachingAllocator, num_blocks: int = 16, block_size: int = 4, watermark=0.0):
    return BlockManager(cls(num_blocks=num_blocks, block_size=block_size), watermark)


# -- admission -------------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_alloc_status_boundaries_with_watermark(cls):
    bm = manager(cls, num_blocks=100, watermark=0.1)  # 10 watermark blocks, 4 tokens a block
    assert bm.watermark_blocks == 10
    assert bm.can_allocate(make_seq([1] * 360)) is AllocStatus.OK  # 90 blocks: 100 - 90 >= 10
    assert bm.can_allocate(make_seq([1] * 361)) is AllocStatus.NEVER  # 91 blocks
    run_prefill(bm, make_seq(list(range(40))))  # 10 blocks in use, 90 free
    assert bm.can_allocate(make_seq([7] * 320)) is AllocStatus.OK  # 80 blocks leave exactly 10
    assert bm.can_allocate(make_seq([7] * 321)) is AllocStatus.LATER


def test_can_allocate_counts_hits_on_live_blocks_as_free():
    bm = manager(num_blocks=10)
    prefix = list(range(12))  # 3 full blocks
    run_prefill(bm, make_seq(prefix + [99]))  # 4 blocks in use, 6 free
    # 3 live hits + 7 new blocks = 10 blocks of table, 7 > 6 free
    assert bm.can_allocate(make_seq(prefix + [5] * 28)) is AllocStatus.LATER
    assert bm.can_allocate(make_seq(prefix + [5] * 24)) is AllocStatus.OK  # 6 new blocks


def test_hits_on_cached_free_blocks_still_consume_free_blocks():
    bm = manager(num_blocks=8)
    prefix = list(range(12))
    seq = make_seq(prefix + [99])
    run_prefill(bm, seq)
    bm.free(seq)
    assert bm.stats().num_cached_free_blocks == 3
    assert bm.can_allocate(make_seq(prefix + [5] * 20)) is AllocStatus.OK  # 8 blocks
    assert bm.can_allocate(make_seq(prefix + [5] * 21)) is AllocStatus.NEVER
    other = make_seq(list(range(100, 112)))
    run_prefill(bm, other)  # 3 blocks taken; the cached ones are still there (hashless went first)
    assert bm.stats().num_cached_free_blocks == 3
    assert bm.can_allocate(make_seq(prefix + [5] * 8)) is AllocStatus.OK  # 5 blocks, 5 free
    assert bm.can_allocate(make_seq(prefix + [5] * 9)) is AllocStatus.LATER


# -- prefix hits -----------------------------------------------------------------------------------


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    bm = manager()
    first = make_seq(list(range(10)))
    run_prefill(bm, first)
    second = make_seq(list(range(8)) + [42, 43])
    assert bm.allocate(second) == 8
    assert bm.block_table(second)[:2] == bm.block_table(first)[:2]
    assert bm.block_table(second)[2] != bm.block_table(first)[2]
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (20, 8)


def test_never_hits_the_whole_prompt():
    bm = manager()
    run_prefill(bm, make_seq(list(range(8))))
    assert bm.allocate(make_seq(list(range(8)))) == 4  # the last block is recomputed for logits
    assert bm.allocate(make_seq(list(range(9)))) == 8


def test_hit_requires_the_same_whole_prefix_and_salt():
    bm = manager()
    run_prefill(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], salt="a"))
    assert bm.allocate(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], salt="b")) == 0
    assert bm.allocate(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])) == 0
    assert bm.allocate(make_seq([0, 2, 3, 4, 5, 6, 7, 8, 9], salt="a")) == 0
    assert bm.allocate(make_seq([1, 2, 3, 4, 0, 6, 7, 8, 9], salt="a")) == 4  # second block differs
    assert bm.allocate(make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], salt="a")) == 8


def test_naive_allocator_never_hits_and_counts_no_queries():
    bm = manager(NaiveAllocator)
    run_prefill(bm, make_seq(list(range(10))))
    assert bm.allocate(make_seq(list(range(10)))) == 0
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (0, 0)


def test_free_releases_tail_blocks_first_so_they_are_evicted_first():
    bm = manager(num_blocks=4)
    seq = make_seq(list(range(12)) + [0])
    run_prefill(bm, seq)
    table = list(bm.block_table(seq))
    bm.free(seq)
    # The hashless last block is reused first, then the deepest cached block.
    assert [bm.allocator.allocate() for _ in range(4)] == [table[3], table[2], table[1], table[0]]


# -- growth and copy-on-write ----------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_append_slots_grows_the_table_one_block_per_block_size_tokens(cls):
    bm = manager(cls)
    seq = make_seq([1, 2, 3])
    run_prefill(bm, seq)
    for token in range(4, 10):
        seq.token_ids.append(token)
        assert bm.can_append_slots(seq)
        assert bm.append_slots(seq) == []
        seq.num_computed_tokens = seq.num_tokens
        bm.mark_computed(seq)
        assert len(bm.block_table(seq)) == -(-seq.num_tokens // 4)
    assert bm.stats().num_token_slots_used == 9


@pytest.mark.parametrize("cls", MACHINE_ALLOCATORS)
def test_open_block_is_try_append_slots_at_a_block_edge(cls):
    """`open_block` (a fast-forward window's edge) opens the block `try_append_slots` would, with the
    same books, and only at an edge with a full table and a free block: elsewhere nothing changes."""
    opened, stepped = manager(cls, num_blocks=4), manager(cls, num_blocks=4)
    seqs = [make_seq([1, 2, 3, 4]), make_seq([1, 2, 3, 4])]
    for bm, seq in zip((opened, stepped), seqs):
        run_prefill(bm, seq)
    edges = 0
    for token in range(5, 17):
        for seq in seqs:
            seq.token_ids.append(token)
        edge = (len(seqs[0].token_ids) - 1) % 4 == 0
        before = opened.stats()
        took = opened.open_block(seqs[0])
        assert took == edge
        if not took:
            assert opened.stats() == before
            assert opened.try_append_slots(seqs[0]) == []
        edges += took
        assert stepped.try_append_slots(seqs[1]) == []
        assert opened.block_table(seqs[0]) == stepped.block_table(seqs[1])
        assert opened.stats() == stepped.stats()
        assert (opened.ledger.num_used, opened.ledger.num_reserved) == (stepped.ledger.num_used,
                                                                         stepped.ledger.num_reserved)
        for bm, seq in zip((opened, stepped), seqs):
            seq.num_computed_tokens = seq.num_tokens
            bm.mark_computed(seq)
    assert edges == 3  # tokens 5, 9, 13 open blocks 2-4, which fill the pool
    seqs[0].token_ids.append(17)
    assert not opened.open_block(seqs[0])  # no free block: the general path refuses it too
    assert opened.try_append_slots(seqs[0]) is None


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_fork_shares_blocks_and_the_first_write_copies_the_shared_last_block(cls):
    bm = manager(cls, num_blocks=4)
    parent = make_seq([1, 2, 3, 4, 5, 6])
    run_prefill(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    full, last = bm.block_table(parent)
    assert bm.block_table(child) == [full, last] and bm.allocator.refcount(last) == 2
    assert bm.stats().num_token_slots_used == 6  # shared blocks count once
    child.token_ids.append(7)
    child.num_computed_tokens = 6
    assert bm.append_slots(child) == [(last, bm.block_table(child)[1])]
    assert bm.block_table(child)[0] == full and bm.allocator.refcount(full) == 2
    assert bm.allocator.refcount(last) == 1 and bm.stats().num_token_slots_used == 6 + 3
    parent.token_ids.append(8)
    assert bm.append_slots(parent) == []  # its last block is private again
    bm.free(parent)
    bm.free(child)
    assert bm.stats().num_allocated_blocks == 0


def test_can_append_slots_counts_the_copy_on_write_block():
    bm = manager(num_blocks=3)
    parent = make_seq([1, 2, 3, 4, 5, 6])
    run_prefill(bm, parent)
    child = parent.fork(1)
    bm.fork(parent, child)
    child.token_ids.extend([7, 8, 9])  # the CoW block plus one new block, 1 free
    assert not bm.can_append_slots(child)
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots(child)
    child.token_ids.pop()
    assert bm.can_append_slots(child)
    assert len(bm.append_slots(child)) == 1 and bm.stats().num_free_blocks == 0


# -- errors and stats ------------------------------------------------------------------------------


def test_free_of_an_unknown_sequence_names_it():
    bm = manager()
    seq = make_seq([1])
    with pytest.raises(KeyError, match=f"sequence {seq.seq_id}"):
        bm.free(seq)
    run_prefill(bm, seq)
    bm.free(seq)
    with pytest.raises(KeyError):
        bm.free(seq)


def test_allocate_twice_and_bad_watermark_are_rejected():
    bm = manager()
    seq = make_seq([1])
    bm.allocate(seq)
    with pytest.raises(ValueError, match=str(seq.seq_id)):
        bm.allocate(seq)
    with pytest.raises(ValueError, match="1.5"):
        BlockManager(NaiveAllocator(num_blocks=4, block_size=4), watermark=1.5)


def test_stats_on_an_empty_pool():
    s = manager(num_blocks=8).stats()
    assert (s.num_allocated_blocks, s.num_free_blocks, s.num_token_slots_used) == (0, 8, 0)
    assert s.kv_usage == 0.0 and s.token_state_fraction == 1.0


def test_stats_report_internal_fragmentation():
    bm = manager(num_blocks=8)
    run_prefill(bm, make_seq([1] * 5))
    s = bm.stats()
    assert s.num_allocated_blocks == 2 and s.kv_usage == 0.25 and s.token_state_fraction == 5 / 8


class StackAllocator(BlockAllocator):
    """A toy LIFO allocator: only the abstract methods, to show a policy plugs in unchanged."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        self.stack = list(range(num_blocks))
        self.refs = [0] * num_blocks

    def allocate(self) -> int:
        if not self.stack:
            raise NoFreeBlocksError("empty")
        b = self.stack.pop()
        self.refs[b] = 1
        return b

    def incref(self, block_id: int) -> None:
        self.refs[block_id] += 1

    def free(self, block_id: int) -> None:
        self.refs[block_id] -= 1
        if not self.refs[block_id]:
            self.stack.append(block_id)

    def refcount(self, block_id: int) -> int:
        return self.refs[block_id]

    @property
    def num_free_blocks(self) -> int:
        return len(self.stack)


def test_a_minimal_allocator_plugs_into_the_block_manager():
    bm = manager(StackAllocator, num_blocks=4)
    seq = make_seq([1, 2, 3, 4, 5])
    run_prefill(bm, seq)
    assert bm.block_table(seq) == [3, 2] and bm.stats().num_cached_free_blocks == 0
    bm.free(seq)
    assert bm.stats().num_free_blocks == 4


# -- random interleavings --------------------------------------------------------------------------


class BlockManagerMachine(RuleBasedStateMachine):
    """Engine-like interleavings checked against a model of KV contents and of the prefix cache.

    `kv[block][slot]` holds what the executor would have written there: the salt and every token
    up to that position. A correct manager only ever exposes slots whose content matches the
    sequence reading them, whether they came from a prefix hit, a fork or a copy-on-write.
    """

    @initialize(
        cls=st.sampled_from(MACHINE_ALLOCATORS),
        num_blocks=st.integers(1, 14),
        block_size=st.sampled_from([1, 2, 4]),
        watermark=st.sampled_from([0.0, 0.2]),
    )
    def setup(self, cls, num_blocks, block_size, watermark):
        self.bm = BlockManager(cls(num_blocks=num_blocks, block_size=block_size), watermark)
        self.alloc = self.bm.allocator
        self.n, self.bs = num_blocks, block_size
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.kv: dict[int, list] = {}
        self.covered: dict[int, int] = {}  # seq id -> slots its table covers
        self.published: dict[int, int] = {}  # seq id -> leading blocks published to the cache
        self.cached: dict[tuple, int] = {}  # (salt, tokens up to the block end) -> block
        self.key_of: dict[int, tuple] = {}

    def key(self, seq: Sequence, end: int) -> tuple:
        return (seq.request.cache_salt, tuple(seq.token_ids[:end]))

    def refs(self) -> list[int]:
        refs = [0] * self.n
        for seq in self.running:
            for b in self.bm.block_table(seq):
                refs[b] += 1
        return refs

    def fresh(self, block_id: int, content: list | None = None) -> None:
        """A reused block loses whatever prefix it cached."""
        key = self.key_of.pop(block_id, None)
        if key is not None:
            del self.cached[key]
        self.kv[block_id] = content if content is not None else [None] * self.bs

    # -- rules

    @precondition(lambda self: len(self.waiting) < 4)
    @rule(
        data=st.data(),
        tail=st.lists(st.integers(0, 1), max_size=10),
        salt=st.sampled_from([None, None, "s"]),
    )
    def add(self, data, tail, salt):
        donors = self.waiting + self.running
        prefix = []
        if donors and data.draw(st.booleans()):
            donor = data.draw(st.sampled_from(donors))
            prefix = donor.token_ids[: data.draw(st.integers(0, donor.num_tokens))]
        tokens = (prefix + tail) or [0]
        self.waiting.append(make_seq(tokens, salt))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        seq = data.draw(st.sampled_from(self.waiting))
        bs, free, wm = self.bs, self.alloc.num_free_blocks, self.bm.watermark_blocks
        required = -(-seq.num_tokens // bs)
        hits = []
        if self.alloc.caches_prefixes:
            for i in range((seq.num_tokens - 1) // bs):
                block_id = self.cached.get(self.key(seq, (i + 1) * bs))
                if block_id is None:
                    break
                hits.append(block_id)
        refs = self.refs()
        needed = required - sum(1 for b in hits if refs[b])
        # A paged allocator can always hand out what is free; the buddy allocator needs one free
        # chunk for the fresh blocks' extent, and never has one larger than `max_allocation`.
        fits = self.alloc.can_allocate_blocks(required - len(hits))
        status = self.bm.can_allocate(seq)
        if self.n - required < wm or required > self.alloc.max_allocation:
            assert status is AllocStatus.NEVER
        elif free - needed >= wm and fits:
            assert status is AllocStatus.OK
        else:
            assert status is AllocStatus.LATER
        if status is not AllocStatus.OK:
            if needed > free or not fits:
                with pytest.raises(NoFreeBlocksError):
                    self.bm.allocate(seq)
            return
        assert self.bm.allocate(seq) == len(hits) * bs
        seq.num_computed_tokens = len(hits) * bs
        table = self.bm.block_table(seq)
        assert table[: len(hits)] == hits and len(table) == required
        if self.alloc.contiguous:
            assert table == list(range(table[0], table[0] + required)), "not one extent"
        for b in table[len(hits) :]:
            self.fresh(b)
        self.covered[seq.seq_id] = seq.num_tokens
        self.published[seq.seq_id] = len(hits)
        self.waiting.remove(seq)
        self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 6), token=st.integers(0, 1))
    def step(self, data, chunk, token):
        """Schedule, write KV for up to `chunk` tokens, publish, and sample when caught up."""
        seq = data.draw(st.sampled_from(self.running))
        bs = self.bs
        if not self.bm.can_append_slots(seq):
            old = list(self.bm.block_table(seq))
            with pytest.raises(NoFreeBlocksError):
                self.bm.append_slots(seq)
            assert self.bm.block_table(seq) == old
            return
        table = self.bm.block_table(seq)
        old_len = len(table)
        copies = self.bm.append_slots(seq)
        for src, dst in copies:
            self.fresh(dst, list(self.kv[src]))
        for b in table[old_len:]:
            self.fresh(b)
        assert len(table) == -(-seq.num_tokens // bs)
        self.covered[seq.seq_id] = seq.num_tokens
        start = seq.num_computed_tokens
        for pos in range(start, min(start + chunk, seq.num_tokens)):
            block_id = table[pos // bs]
            assert self.alloc.refcount(block_id) == 1, "write into a shared block"
            self.kv[block_id][pos % bs] = self.key(seq, pos + 1)
        seq.num_computed_tokens = min(start + chunk, seq.num_tokens)
        self.bm.mark_computed(seq)
        if self.alloc.caches_prefixes:
            for i in range(self.published[seq.seq_id], seq.num_computed_tokens // bs):
                key, block_id = self.key(seq, (i + 1) * bs), table[i]
                if block_id not in self.key_of and key not in self.cached:
                    self.cached[key] = block_id
                    self.key_of[block_id] = key
            self.published[seq.seq_id] = max(self.published[seq.seq_id], seq.num_computed_tokens // bs)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(token)

    @precondition(lambda self: self.running and len(self.running) < 8)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.running))
        child = parent.fork(1)
        self.bm.fork(parent, child)
        assert self.bm.block_table(child) == self.bm.block_table(parent)
        assert self.bm.block_table(child) is not self.bm.block_table(parent)
        self.covered[child.seq_id] = self.covered[parent.seq_id]
        self.published[child.seq_id] = self.published[parent.seq_id]
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), requeue=st.booleans())
    def finish_or_preempt(self, data, requeue):
        seq = data.draw(st.sampled_from(self.running))
        self.bm.free(seq)
        assert not self.bm.has_blocks(seq)
        self.running.remove(seq)
        if requeue:  # recompute preemption: the same tokens are admitted again later
            seq.num_computed_tokens = 0
            self.waiting.append(seq)

    # -- invariants

    @invariant()
    def refcounts_match_block_tables(self):
        refs = self.refs()
        assert [self.alloc.refcount(b) for b in range(self.n)] == refs
        unreferenced = {b for b in range(self.n) if refs[b] == 0}
        if isinstance(self.alloc, BuddyAllocator):
            # free chunks, expanded to block ids; the other unreferenced blocks belong to live
            # extents (rounding, or blocks freed while the rest of their extent is still held)
            free_ids = [b for order, starts in enumerate(self.alloc._free) for start in starts
                        for b in range(start, start + (1 << order))]
            assert len(unreferenced) == self.alloc.num_free_blocks + self.alloc.num_unassigned_blocks
        else:
            free_ids = list(self.alloc.free_ids()) if isinstance(self.alloc, NaiveAllocator) else [
                *self.alloc._hashless, *(b for b in range(self.alloc.num_blocks) if b in self.alloc.eviction)]
            assert self.alloc.num_unassigned_blocks == 0
        assert len(free_ids) == len(set(free_ids)) == self.alloc.num_free_blocks
        assert set(free_ids) <= unreferenced, "free and referenced"
        if not self.alloc.contiguous:
            assert set(free_ids) == unreferenced, "neither free nor referenced"
        if self.alloc.caches_prefixes:
            cached_free = sum(1 for b in free_ids if b in self.key_of)
            assert self.alloc.num_cached_free_blocks == cached_free

    @invariant()
    def sequences_read_their_own_kv(self):
        bs = self.bs
        for seq in self.running:
            table = self.bm.block_table(seq)
            assert len(table) == -(-self.covered[seq.seq_id] // bs)
            for pos in range(seq.num_computed_tokens):
                assert self.kv[table[pos // bs]][pos % bs] == self.key(seq, pos + 1)

    @invariant()
    def stats_match_a_recount(self):
        refs = self.refs()
        fill: dict[int, int] = {}
        for seq in self.running:
            covered = self.covered[seq.seq_id]
            for i, b in enumerate(self.bm.block_table(seq)):
                fill[b] = max(fill.get(b, 0), min(self.bs, covered - i * self.bs))
        s = self.bm.stats()
        assert s.num_allocated_blocks == sum(1 for r in refs if r) + s.num_unassigned_blocks
        assert s.num_allocated_blocks + s.num_free_blocks == s.num_total_blocks == self.n
        assert s.num_token_slots_used == sum(fill.values())
        assert 0.0 <= s.kv_usage <= 1.0 and 0.0 < s.token_state_fraction <= 1.0

    @invariant()
    def breakdown_sums_to_one(self):
        # `blocked_blocks` is what a request waiting for memory needs: it decides what free
        # memory counts as stranded (external fragmentation)
        for blocked in sorted({0, 1, 2, 3, self.alloc.max_allocation, self.n}):
            s = self.bm.stats(blocked)
            assert s.num_internal_frag_slots >= 0
            assert 0 <= s.num_stranded_free_blocks <= s.num_free_blocks
            shares = s.breakdown()
            assert set(shares) == {"token_state", "reserved", "internal_frag", "external_frag", "free"}
            assert all(0.0 <= v <= 1.0 for v in shares.values()), shares
            assert abs(sum(shares.values()) - 1.0) <= 1e-9, shares

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.running:
            self.bm.free(seq)
        s = self.bm.stats()
        assert s.num_allocated_blocks == 0 and s.num_free_blocks == self.n
        assert s.num_token_slots_used == 0 and s.num_reserved_slots == 0 and s.num_unassigned_blocks == 0
        assert all(self.alloc.refcount(b) == 0 for b in range(self.n))
        # every extent merged back: the whole largest root is one free chunk again
        assert self.alloc.can_allocate_blocks(self.alloc.max_allocation)


BlockManagerMachine.TestCase.settings = settings(max_examples=examples(200), stateful_step_count=50, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_a_block_edge_takes_allocate_only_where_allocate_blocks_is_the_base_class():
    """`plain_blocks` is what lets a block's edge take `allocate()` for `allocate_blocks(1)`: the
    built-in paged allocators keep the base class's, the buddy allocator (extents) does not."""
    assert plain_blocks(NaiveAllocator(4, 4)) and plain_blocks(PrefixCachingAllocator(4, 4))
    assert not plain_blocks(BuddyAllocator(4, 4))


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_free_clears_the_books_of_reserved_and_shared_blocks(cls):
    """`free` drops each reference and clears a block's slots (used and reserved, as `account(b, 0, 0)`
    would) only when nobody holds it any more: a block a fork still holds keeps its books."""
    bm = BlockManager(cls(num_blocks=16, block_size=4), 0.0, MaxReservation(16))
    parent = make_seq([1, 2, 3, 4, 5, 6])
    run_prefill(bm, parent)
    reserved = bm.stats().num_reserved_slots
    assert reserved > 0
    child = parent.fork(1)
    bm.fork(parent, child)
    bm.free(parent)
    assert (bm.ledger.num_used, bm.ledger.num_reserved) == (6, reserved)  # the child holds every block
    bm.free(child)
    assert (bm.ledger.num_used, bm.ledger.num_reserved) == (0, 0)
    assert bm.ledger._fill == [0] * 16 and bm.ledger._future == [0] * 16
