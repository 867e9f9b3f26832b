"""Allocators, the O(1) free queue and block hashing."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged.config.plugins import check_plugin
from paged.memory import BlockAllocator, NaiveAllocator, NoFreeBlocksError, PrefixCachingAllocator
from paged.memory.free_queue import FreeBlockQueue
from paged.memory.hashing import block_hash
from tests.hypothesis_budget import examples

ALLOCATORS = [NaiveAllocator, PrefixCachingAllocator]


def h(name: str) -> bytes:
    return block_hash(None, [], name)


# -- free queue ------------------------------------------------------------------------------------


def test_free_queue_starts_in_block_id_order():
    q = FreeBlockQueue(5)
    assert list(q) == [0, 1, 2, 3, 4] and len(q) == 5


def test_free_queue_remove_from_middle_head_and_tail():
    q = FreeBlockQueue(5)
    q.remove(2)
    assert list(q) == [0, 1, 3, 4] and 2 not in q and 3 in q
    q.remove(0)
    q.remove(4)
    assert list(q) == [1, 3] and len(q) == 2


def test_free_queue_popleft_append_appendleft():
    q = FreeBlockQueue(4)
    assert q.popleft() == 0
    assert q.popleft() == 1
    q.append(0)
    q.appendleft(1)
    assert list(q) == [1, 2, 3, 0]
    assert [q.popleft() for _ in range(4)] == [1, 2, 3, 0]
    assert len(q) == 0 and list(q) == []
    with pytest.raises(IndexError):
        q.popleft()
    q.append(3)
    assert list(q) == [3]


def test_free_queue_rejects_double_insert_and_removing_absent_block():
    q = FreeBlockQueue(3)
    with pytest.raises(AssertionError):
        q.append(1)
    q.remove(1)
    with pytest.raises(AssertionError):
        q.remove(1)


@given(st.lists(st.tuples(st.sampled_from(["pop", "append", "appendleft", "remove"]), st.integers(0, 7))))
def test_free_queue_matches_a_list_model(ops):
    q, model = FreeBlockQueue(8), list(range(8))
    for op, b in ops:
        if op == "pop" and model:
            assert q.popleft() == model.pop(0)
        elif op == "append" and b not in model:
            q.append(b)
            model.append(b)
        elif op == "appendleft" and b not in model:
            q.appendleft(b)
            model.insert(0, b)
        elif op == "remove" and b in model:
            q.remove(b)
            model.remove(b)
        assert list(q) == model and len(q) == len(model)
        assert all((i in q) == (i in model) for i in range(8))


# -- both allocators -------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", ALLOCATORS)
@pytest.mark.parametrize("bad", [0, -3])
def test_rejects_non_positive_num_blocks_naming_the_value(cls, bad):
    with pytest.raises(ValueError, match=f"num_blocks.*{bad}"):
        cls(num_blocks=bad, block_size=16)


@pytest.mark.parametrize("cls", ALLOCATORS)
@pytest.mark.parametrize("bad", [0, -16])
def test_rejects_non_positive_block_size_naming_the_value(cls, bad):
    with pytest.raises(ValueError, match=f"block_size.*{bad}"):
        cls(num_blocks=4, block_size=bad)


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_allocates_every_block_once_then_raises(cls):
    a = cls(num_blocks=4, block_size=16)
    ids = [a.allocate() for _ in range(4)]
    assert sorted(ids) == [0, 1, 2, 3]
    assert a.num_free_blocks == 0 and all(a.refcount(b) == 1 for b in ids)
    with pytest.raises(NoFreeBlocksError):
        a.allocate()
    a.free(ids[2])
    assert a.num_free_blocks == 1 and a.allocate() == ids[2]


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_block_returns_to_pool_only_when_last_reference_drops(cls):
    a = cls(num_blocks=2, block_size=16)
    b = a.allocate()
    a.incref(b)
    a.free(b)
    assert a.refcount(b) == 1 and a.num_free_blocks == 1
    a.free(b)
    assert a.refcount(b) == 0 and a.num_free_blocks == 2


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_double_free_raises(cls):
    a = cls(num_blocks=2, block_size=16)
    b = a.allocate()
    a.free(b)
    with pytest.raises(RuntimeError, match="double free"):
        a.free(b)
    assert a.num_free_blocks == 2


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_loads_by_config_import_path(cls):
    plugin = check_plugin(
        {"_target_": f"{cls.__module__}.{cls.__name__}"}, "allocator", BlockAllocator,
        provided=("num_blocks", "block_size"),
    )
    a = plugin.build(num_blocks=3, block_size=8)
    assert isinstance(a, BlockAllocator) and a.num_blocks == 3 and a.block_size == 8


def test_naive_allocator_never_caches():
    a = NaiveAllocator(num_blocks=2, block_size=16)
    b = a.allocate()
    a.insert(b, h("x"))
    assert a.match(h("x")) is None and a.peek(h("x")) is None
    a.free(b)
    assert a.num_cached_free_blocks == 0 and not a.caches_prefixes


# -- prefix caching --------------------------------------------------------------------------------


@given(st.lists(st.booleans(), max_size=60), st.randoms(use_true_random=False))
def test_naive_hands_out_blocks_as_a_deque_of_every_id_would(ops, rng):
    """Freed blocks first, the last freed first (vLLM's LIFO reuse), then the never-used ones in id
    order: the model is the deque of every id the allocator no longer builds up front."""
    alloc = NaiveAllocator(8, 16)
    model, held = deque(range(8)), []
    for allocate in ops:
        if allocate and model:
            held.append(alloc.allocate())
            assert held[-1] == model.popleft()
        elif held:
            block = held.pop(rng.randrange(len(held)))
            alloc.free(block)
            model.appendleft(block)
        assert list(alloc.free_ids()) == list(model) and alloc.num_free_blocks == len(model)


def test_freed_hashed_block_stays_cached_and_is_revived_by_match():
    a = PrefixCachingAllocator(num_blocks=3, block_size=16)
    b = a.allocate()
    a.insert(b, h("x"))
    a.free(b)
    assert a.num_free_blocks == 3 and a.num_cached_free_blocks == 1
    assert a.peek(h("x")) == b and a.refcount(b) == 0
    assert a.match(h("x")) == b
    assert a.refcount(b) == 1 and a.num_free_blocks == 2 and a.num_cached_free_blocks == 0
    assert a.match(h("x")) == b and a.refcount(b) == 2
    assert a.match(h("y")) is None


def test_eviction_is_least_recently_freed_first_and_drops_the_hash():
    a = PrefixCachingAllocator(num_blocks=3, block_size=16)
    blocks = [a.allocate() for _ in range(3)]
    for b, name in zip(blocks, "abc", strict=True):
        a.insert(b, h(name))
    for b in (blocks[1], blocks[0], blocks[2]):
        a.free(b)
    a.free(a.match(h("a")))  # a hit refreshes "a": it is now the most recently freed
    assert [a.allocate() for _ in range(3)] == [blocks[1], blocks[2], blocks[0]]
    assert a.num_evictions == 3 and a.num_cached_free_blocks == 0
    assert all(a.peek(h(name)) is None for name in "abc")


def test_hashless_blocks_are_reused_before_cached_ones():
    a = PrefixCachingAllocator(num_blocks=4, block_size=16)
    cached, plain = a.allocate(), a.allocate()
    a.insert(cached, h("x"))
    a.free(cached)
    a.free(plain)
    assert a.allocate() == plain
    assert [a.allocate() for _ in range(2)] == [2, 3]  # never-used blocks come before the cached one
    assert a.allocate() == cached and a.num_evictions == 1 and a.peek(h("x")) is None


def test_insert_of_an_already_cached_hash_keeps_the_existing_block():
    a = PrefixCachingAllocator(num_blocks=2, block_size=16)
    first, second = a.allocate(), a.allocate()
    a.insert(first, h("x"))
    a.insert(second, h("x"))
    assert a.peek(h("x")) == first
    a.free(second)
    assert a.num_cached_free_blocks == 0  # the duplicate stayed hashless


@pytest.mark.parametrize("cls", ALLOCATORS)
def test_reset_prefix_cache_refuses_while_blocks_are_referenced(cls):
    a = cls(num_blocks=2, block_size=16)
    b = a.allocate()
    a.insert(b, h("x"))
    assert not a.reset_prefix_cache()
    a.free(b)
    assert a.reset_prefix_cache()


def test_reset_prefix_cache_forgets_every_cached_block():
    a = PrefixCachingAllocator(num_blocks=3, block_size=16)
    blocks = [a.allocate() for _ in range(2)]
    for b, name in zip(blocks, "ab", strict=True):
        a.insert(b, h(name))
        a.free(b)
    assert a.reset_prefix_cache()
    assert a.num_cached_free_blocks == 0 and a.num_free_blocks == 3
    assert a.peek(h("a")) is None and a.match(h("b")) is None
    assert sorted(a.allocate() for _ in range(3)) == [0, 1, 2] and a.num_evictions == 0


# -- allocator vs a reference model ----------------------------------------------------------------


class PrefixAllocatorMachine(RuleBasedStateMachine):
    """Every operation against a list-based LRU model of the prefix-caching allocator."""

    N = 6

    def __init__(self) -> None:
        super().__init__()
        self.a = PrefixCachingAllocator(num_blocks=self.N, block_size=4)
        self.refs = [0] * self.N
        self.hash_of: dict[int, str] = {}
        self.queue = list(range(self.N))  # front is reused first

    @precondition(lambda self: self.queue)
    @rule()
    def allocate(self):
        b = self.a.allocate()
        assert b == self.queue.pop(0)
        self.hash_of.pop(b, None)
        self.refs[b] = 1

    @rule(data=st.data())
    def free(self, data):
        live = [b for b in range(self.N) if self.refs[b]]
        if not live:
            return
        b = data.draw(st.sampled_from(live))
        self.a.free(b)
        self.refs[b] -= 1
        if not self.refs[b]:
            if b in self.hash_of:
                self.queue.append(b)
            else:
                self.queue.insert(0, b)

    @rule(data=st.data(), name=st.sampled_from("abcd"))
    def insert(self, data, name):
        live = [b for b in range(self.N) if self.refs[b] and b not in self.hash_of]
        if not live:
            return
        b = data.draw(st.sampled_from(live))
        self.a.insert(b, h(name))
        if name not in self.hash_of.values():
            self.hash_of[b] = name

    @rule(name=st.sampled_from("abcd"))
    def match(self, name):
        owner = next((b for b, n in self.hash_of.items() if n == name), None)
        assert self.a.match(h(name)) == owner
        if owner is not None:
            if not self.refs[owner]:
                self.queue.remove(owner)
            self.refs[owner] += 1

    @invariant()
    def agrees_with_model(self):
        assert [self.a.refcount(b) for b in range(self.N)] == self.refs
        assert self.a.num_free_blocks == len(self.queue) == self.refs.count(0)
        assert self.a.num_cached_free_blocks == sum(1 for b in self.queue if b in self.hash_of)


PrefixAllocatorMachine.TestCase.settings = settings(max_examples=examples(60), stateful_step_count=40, deadline=None)
TestPrefixAllocatorMachine = PrefixAllocatorMachine.TestCase


# -- hashing ---------------------------------------------------------------------------------------


def test_block_hash_is_deterministic_128_bit():
    assert block_hash(None, [1, 2, 3]) == block_hash(None, [1, 2, 3])
    assert len(block_hash(None, [1, 2, 3])) == 16


def test_block_hash_depends_on_parent_tokens_and_salt():
    base = block_hash(None, [1, 2])
    variants = [
        block_hash(block_hash(None, [0]), [1, 2]),
        block_hash(None, [2, 1]),
        block_hash(None, [1, 2], "salt"),
        block_hash(None, [1, 2], ""),
        block_hash(None, [1, 2, 0]),
        block_hash(None, [1, 2 + 2**40]),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_block_hash_encoding_keeps_tokens_and_salt_apart():
    # Without a length prefix, token 0x..01 followed by no salt could equal no token plus a salt.
    salt = (1).to_bytes(8, "little")[1:].decode()
    assert block_hash(None, [1]) != block_hash(None, [], salt)
