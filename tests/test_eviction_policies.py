"""Eviction policies (`paged.memory.eviction`): each policy's own behaviour, the invariants every one
keeps under long random request streams on the prefix-caching allocator, and the config seam."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged.config import ConfigError, compose_config
from paged.engine.builder import check_config
from paged.experiment.run import run_quietly
from paged.memory import NoFreeBlocksError, PrefixCachingAllocator
from paged.memory.eviction import (
    POLICIES,
    ARCPolicy,
    CostPolicy,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    S3FIFOPolicy,
)
from tests.hypothesis_budget import examples


def h(name: str) -> bytes:
    return name.encode()


def published(policy: EvictionPolicy, *blocks: int, position: int = 0) -> EvictionPolicy:
    for b in blocks:
        policy.insert(b, h(f"b{b}"), position)
    return policy


def drain(policy: EvictionPolicy) -> list[int]:
    return [policy.evict() for _ in range(len(policy))]


# -- each policy on its own ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_tracks_only_released_blocks_and_raises_when_empty(name):
    policy = published(POLICIES[name](), 0, 1)
    assert len(policy) == 0 and 0 not in policy
    with pytest.raises(NoFreeBlocksError):
        policy.evict()
    policy.release(0)
    policy.release(1)
    policy.acquire(1)
    assert len(policy) == 1 and 0 in policy and 1 not in policy
    assert policy.evict() == 0 and len(policy) == 0


def test_lru_evicts_in_release_order_whatever_the_hits():
    policy = published(LRUPolicy(), 0, 1, 2)
    policy.hit(2)
    for b in (2, 0, 1):
        policy.release(b)
    assert drain(policy) == [2, 0, 1]


def test_lfu_keeps_the_hot_block():
    policy = published(LFUPolicy(), 0, 1, 2)
    for _ in range(3):
        policy.hit(0)
    policy.hit(2)
    for b in (0, 1, 2):
        policy.release(b)
    assert drain(policy) == [1, 2, 0]


def test_fifo_evicts_in_insertion_order_whatever_the_reuse_and_release_order():
    policy = published(FIFOPolicy(), 0, 1, 2)
    policy.hit(0)
    for b in (2, 0, 1):
        policy.release(b)
    policy.acquire(0)  # reused and released again: it keeps its place
    policy.release(0)
    assert drain(policy) == [0, 1, 2]


def test_s3fifo_drops_one_hit_wonders_from_the_small_queue_and_keeps_the_reused():
    policy = S3FIFOPolicy(small_ratio=0.25)
    published(policy, *range(8))
    policy.hit(0)  # reused while in the small queue: promoted on its turn
    for b in range(8):
        policy.release(b)
    evicted = [policy.evict() for _ in range(6)]
    assert 0 not in evicted and evicted == [1, 2, 3, 4, 5, 6]


def test_s3fifo_ghost_sends_a_recomputed_block_to_the_main_queue():
    policy = S3FIFOPolicy(small_ratio=0.25)
    published(policy, *range(4))
    for b in range(4):
        policy.release(b)
    assert policy.evict() == 0  # not reused: evicted from the small queue, its hash now a ghost
    policy.insert(0, h("b0"), 0)  # the same content published again (block id reused)
    policy.release(0)
    published(policy, 4, 5)
    for b in (4, 5):
        policy.release(b)
    # the small queue (1, 2, 3, 4, 5) is over its share: all its blocks go before the ghost-hit block 0
    assert drain(policy) == [1, 2, 3, 4, 5, 0]


def test_arc_adapts_its_recency_target_to_ghost_hits():
    policy = ARCPolicy()
    published(policy, *range(4))
    for b in range(4):
        policy.release(b)
    assert policy.evict() == 0 and policy.recency_target == 0.0  # T1's LRU block, ghost in B1
    policy.insert(0, h("b0"), 0)  # a B1 ghost hit: T1 should have been larger
    assert policy.recency_target == 1.0
    policy.hit(1)  # reused: T2
    policy.acquire(1)
    policy.release(1)
    policy.release(0)
    # T1 (2, 3) is over its target of 1, so T1 gives up its LRU block, not T2
    assert policy.evict() == 2
    # now T1 (3) is at its target: T2 gives up its LRU block (1, released before 0), ghost in B2
    assert policy.evict() == 1
    policy.insert(1, h("b1"), 0)  # a B2 ghost hit: T2 should have been larger
    assert policy.recency_target == 0.0


def test_cost_keeps_a_deep_hot_block_that_lfu_would_evict():
    for cls, survivor in ((CostPolicy, 1), (LFUPolicy, 0)):
        policy = cls()
        policy.insert(0, h("shallow"), 0)
        policy.insert(1, h("deep"), 12)
        policy.hit(0)
        policy.hit(1)
        for b in (0, 1):
            policy.release(b)
        assert policy.evict() == 1 - survivor, cls.name


def test_cost_grows_with_depth():
    policy = CostPolicy(depth_cost=0.5)
    assert [policy.recompute_cost(p) for p in (0, 1, 4)] == [1.0, 1.5, 3.0]
    with pytest.raises(ValueError, match="depth_cost"):
        CostPolicy(depth_cost=-1)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_chain_released_together_is_evicted_tail_first(name):
    """Whatever ranks the head below its tail (FIFO's insertion order, the cost of depth), a chain
    released last block first goes tail first."""
    policy = POLICIES[name]()
    for position in range(4):  # one chain, head first, each block hit as often as a lookup would
        policy.insert(position, h(f"c{position}"), position)
    for depth in range(4):
        for b in range(depth + 1):
            policy.hit(b)
    for b in (3, 2, 1, 0):
        policy.release(b)
    assert drain(policy) == [3, 2, 1, 0]


# -- the allocator delegates -----------------------------------------------------------------------


def test_allocator_asks_its_policy_and_calls_the_evict_hook_before_handing_the_block_out():
    a = PrefixCachingAllocator(num_blocks=3, block_size=16, eviction=LFUPolicy())
    seen: list[tuple[int, bytes, int]] = []
    a.on_evict = lambda block_id, block_hash: seen.append((block_id, block_hash, a.refcount(block_id)))
    blocks = a.allocate_blocks(3)
    for i, b in enumerate(blocks):
        a.insert(b, h(f"x{i}"), i)
        a.free(b)
    for _ in range(2):
        a.free(a.match(h("x0")))  # x0 is hot
    first = a.allocate()
    assert seen == [(first, h("x2"), 0)] and a.peek(h("x2")) is None and a.position(first) == 2
    assert a.allocate() == blocks[1] and a.num_evictions == 2 and a.peek(h("x0")) == blocks[0]


def test_allocator_defaults_to_lru():
    assert isinstance(PrefixCachingAllocator(num_blocks=2, block_size=16).eviction, LRUPolicy)


# -- invariants under long random request streams --------------------------------------------------

# Four documents of six blocks; documents 0/1 and 2/3 share their first two blocks, so chains branch.
DOCS, DOC_BLOCKS, SHARED = 4, 6, 2
NUM_BLOCKS = 12


def chain(doc: int, length: int) -> list[bytes]:
    return [h(f"g{doc // 2}:{j}" if j < SHARED else f"d{doc}:{j}") for j in range(length)]


ANCESTORS = {hashes[j]: set(hashes[:j]) for doc in range(DOCS) for hashes in [chain(doc, DOC_BLOCKS)]
             for j in range(DOC_BLOCKS)}
# a driver step: (kind, doc, length); kinds 0-5 start a request, 6-8 finish one, 9 finish all and reset
STEPS = st.lists(st.tuples(st.integers(0, 9), st.integers(0, DOCS - 1), st.integers(1, DOC_BLOCKS)),
                 min_size=250, max_size=250)


class RequestStream:
    """Requests on a PrefixCachingAllocator with `policy`, as the block manager makes them: look the
    chain up, take the hits, allocate and publish the misses, later free the table last block first.
    Every eviction and every step is checked against a model of refcounts and cached hashes."""

    def __init__(self, policy: EvictionPolicy, strict_chain_order: bool) -> None:
        self.policy = policy
        self.strict = strict_chain_order
        self.a = PrefixCachingAllocator(num_blocks=NUM_BLOCKS, block_size=4, eviction=policy)
        self.a.on_evict = self.evicted
        self.refs = [0] * NUM_BLOCKS
        self.hash_of: dict[int, bytes] = {}
        self.running: list[list[int]] = []
        # blocks of chains released together: block -> (burst, index in it), while still evictable
        self.burst_of: dict[int, tuple[int, int]] = {}
        self.bursts: list[list[int]] = []

    def evictable(self, b: int) -> bool:
        return self.refs[b] == 0 and b in self.hash_of

    def evicted(self, block_id: int, block_hash: bytes) -> None:
        assert self.refs[block_id] == 0, "evicted a block in use"
        assert self.hash_of.get(block_id) == block_hash, "evicted a block that is not cached"
        if block_id in self.burst_of:
            burst, index = self.burst_of[block_id]
            deeper = [b for i, b in enumerate(self.bursts[burst][:index]) if self.burst_of.get(b) == (burst, i)]
            assert not deeper, f"evicted {block_id} before the deeper blocks {deeper} of its chain"
        if self.strict:
            tails = [b for b, bh in self.hash_of.items() if self.evictable(b) and block_hash in ANCESTORS[bh]]
            assert not tails, f"evicted {block_hash!r} while its descendants {tails} are cached"
        del self.hash_of[block_id]
        self.burst_of.pop(block_id, None)

    def start(self, doc: int, length: int) -> None:
        hashes = chain(doc, length)
        hits = 0
        while hits < length and self.a.peek(hashes[hits]) is not None:
            hits += 1
        if length - hits > self.a.num_free_blocks - sum(self.refs[self.a.peek(x)] == 0 for x in hashes[:hits]):
            return
        table = [self.a.match(x) for x in hashes[:hits]]
        for b in table:
            self.refs[b] += 1
            self.burst_of.pop(b, None)
        for j in range(hits, length):
            b = self.a.allocate()
            assert self.refs[b] == 0 and b not in self.hash_of, "handed out a block in use or still cached"
            self.refs[b] = 1
            if self.a.peek(hashes[j]) is None:  # else a duplicate: it stays hashless, the cached block is kept
                self.hash_of[b] = hashes[j]
            self.a.insert(b, hashes[j], j)
            table.append(b)
        self.running.append(table)

    def finish(self, index: int) -> None:
        table = self.running.pop(index % len(self.running))
        released_together = all(self.refs[b] == 1 for b in table)
        for b in reversed(table):
            self.a.free(b)
            self.refs[b] -= 1
        if not released_together:
            return
        # runs of cached blocks, deepest first; a hashless duplicate splits the chain (the policy never sees it)
        self.bursts.append([])
        for b in reversed(table):
            if b not in self.hash_of:
                self.bursts.append([])
                continue
            self.burst_of[b] = (len(self.bursts) - 1, len(self.bursts[-1]))
            self.bursts[-1].append(b)

    def step(self, kind: int, doc: int, length: int) -> None:
        if kind <= 5:
            self.start(doc, length)
        elif kind <= 8 and self.running:
            self.finish(doc * DOC_BLOCKS + length)
        elif kind == 9:
            while self.running:
                self.finish(0)
            assert self.a.reset_prefix_cache()
            self.hash_of.clear()
            self.burst_of.clear()
        self.check()

    def check(self) -> None:
        a = self.a
        assert [a.refcount(b) for b in range(NUM_BLOCKS)] == self.refs
        num_evictable = sum(self.evictable(b) for b in range(NUM_BLOCKS))
        assert len(self.policy) == a.num_cached_free_blocks == num_evictable, "evictable count is off"
        assert a.num_free_blocks == self.refs.count(0)
        assert all((b in self.policy) == self.evictable(b) for b in range(NUM_BLOCKS))
        for doc in range(DOCS):
            for x in chain(doc, DOC_BLOCKS):  # a hit is a block that holds that hash
                b = a.peek(x)
                assert (b is None and x not in self.hash_of.values()) or self.hash_of.get(b) == x


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=examples(40), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(steps=STEPS)
def test_policy_invariants_under_random_request_streams(name, steps):
    """40 examples x 250 steps = 10,000 driver steps per policy, each a request's lookup, matches,
    allocations and publishes, or a table's release (or a reset): about 4 x 10^4 policy operations
    (insert, hit, release, acquire, evict, remove). LRU and LFU also never evict a block while a
    descendant of it is evictable; the others keep chain order for chains released together."""
    stream = RequestStream(POLICIES[name](), strict_chain_order=name in ("lru", "lfu"))
    for kind, doc, length in steps:
        stream.step(kind, doc, length)


# -- config ----------------------------------------------------------------------------------------


def test_eviction_group_composes_and_builds_every_policy():
    assert compose_config().allocator.eviction._target_ == "paged.memory.eviction.lru.LRUPolicy"
    for name, cls in POLICIES.items():
        plugins = check_config(compose_config([f"allocator/eviction={name}"]))
        assert plugins.eviction is not None and plugins.eviction.cls is cls
    assert check_config(compose_config(["allocator=naive"])).eviction is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["allocator/eviction=lfuu"], "allocator/eviction=lfuu is not an option; did you mean lfu?; the options of "
         "allocator/eviction: arc, cost, fifo, lfu, lru, s3fifo"),
        (["allocator=naive", "allocator/eviction=lfu"], "allocator/eviction=lfu chooses what a prefix cache evicts, "
         "but allocator=naive caches no prefixes"),
        (["allocator=orca-max", "allocator/eviction=arc"], "allocator=orca-max caches no prefixes"),
        (["allocator.eviction._target_=paged.memory.naive.NaiveAllocator"], "is not a subclass of EvictionPolicy"),
        (["allocator/eviction=s3fifo", "allocator.eviction.smal_ratio=0.2"],
         "did you mean allocator.eviction.small_ratio"),
    ],
)
def test_bad_eviction_config_is_one_line_before_the_run(overrides, message):
    with pytest.raises(ConfigError) as err:
        check_config(compose_config(overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


SIM = ["executor=sim", "model=llama-3-8b", "hardware=h100-sxm", "workload.num_requests=40",
       "workload.shared_prefix_len=64", "workload.num_prefixes=8", "allocator.num_blocks=120"]


def test_default_lru_runs_an_engine_and_reports_its_evictions():
    default, _ = run_quietly(SIM)
    lru, _ = run_quietly([*SIM, "allocator/eviction=lru"])
    assert default["eviction_policy"] == "lru" and default["num_evictions"] > 0
    for key in ("prefix_cache_hit_rate", "num_evictions", "computed_tokens", "output_tokens"):
        assert lru[key] == default[key], key
    lfu, _ = run_quietly([*SIM, "allocator/eviction=lfu"])
    assert lfu["eviction_policy"] == "lfu" and lfu["num_finished"] == default["num_finished"]
    naive, _ = run_quietly([*SIM, "allocator=naive"])
    assert naive["eviction_policy"] is None and naive["num_evictions"] == 0
