"""The Orca baselines and the memory breakdown: the buddy allocator, the up-front reservations, and
random engine-like interleavings (admission, decode, fork, recompute and swap preemption, sliding
window) over every allocator/reservation pairing, checked for leaks, double frees, refcounts, KV
contents and a breakdown that sums to 1."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from paged.memory import (
    AllocStatus,
    BlockManager,
    BuddyAllocator,
    ExactReservation,
    MaxReservation,
    NaiveAllocator,
    NoFreeBlocksError,
    OracleReservation,
    Pow2Reservation,
    PrefixCachingAllocator,
)
from paged.memory.buddy import order_of
from paged.memory.reservation import final_length
from paged.request import Request, SamplingParams, Sequence
from tests.hypothesis_budget import examples


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_request(prompt_len: int, max_tokens: int, *, ignore_eos: bool = True, n: int = 1) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, n=n, temperature=0.0)
    return Request("r", list(range(prompt_len)), params)


def free_chunks(alloc: BuddyAllocator) -> list[tuple[int, int]]:
    """The buddy allocator's free chunks as sorted (start, size) pairs."""
    return sorted((start, 1 << order) for order, starts in enumerate(alloc._free) for start in starts)


# -- buddy allocator -------------------------------------------------------------------------------


def test_order_of_rounds_up_to_a_power_of_two():
    assert [order_of(n) for n in (0, 1, 2, 3, 4, 5, 8, 9)] == [0, 0, 1, 2, 2, 3, 3, 4]


def test_buddy_splits_and_merges_back_to_one_free_chunk():
    a = BuddyAllocator(num_blocks=16, block_size=4)
    assert free_chunks(a) == [(0, 16)] and a.max_allocation == 16
    x = a.allocate_blocks(1)
    assert x == [0] and free_chunks(a) == [(1, 1), (2, 2), (4, 4), (8, 8)]
    y = a.allocate_blocks(4)
    assert y == [4, 5, 6, 7] and free_chunks(a) == [(1, 1), (2, 2), (8, 8)]
    z = a.allocate_blocks(2)
    assert z == [2, 3] and a.num_free_blocks == 16 - 7
    for block_id in x + z + y:
        a.free(block_id)
    assert free_chunks(a) == [(0, 16)] and a.num_free_blocks == 16 and a.num_unassigned_blocks == 0
    assert a.allocate_blocks(16) == list(range(16))


def test_buddy_merges_in_any_free_order():
    a = BuddyAllocator(num_blocks=8, block_size=1)
    extents = [a.allocate_blocks(1) for _ in range(8)]
    assert [e[0] for e in extents] == list(range(8)) and a.num_free_blocks == 0
    for start in (5, 2, 7, 0, 3, 6, 1, 4):
        a.free(start)
    assert free_chunks(a) == [(0, 8)]


def test_non_power_of_two_pool_is_a_row_of_roots():
    a = BuddyAllocator(num_blocks=13, block_size=4)
    assert free_chunks(a) == [(0, 8), (8, 4), (12, 1)]
    assert a.max_allocation == 8 and a.num_free_blocks == 13
    assert a.can_allocate_blocks(8) and not a.can_allocate_blocks(9)
    with pytest.raises(NoFreeBlocksError):
        a.allocate_blocks(9)  # 13 blocks are free, but no extent of 16
    big = a.allocate_blocks(8)
    assert big == list(range(8))
    assert a.allocate_blocks(3) == [8, 9, 10]  # the 4-root, one block rounded away
    assert a.allocate_blocks(1) == [12]
    assert a.num_free_blocks == 0 and a.num_unassigned_blocks == 1
    assert not a.can_allocate_blocks(1)
    for block_id in range(8, 13):
        if a.refcount(block_id):
            a.free(block_id)
    # roots never merge with each other: the 4-root and the 1-root come back as they were
    assert free_chunks(a) == [(8, 4), (12, 1)]
    for block_id in big:
        a.free(block_id)
    assert free_chunks(a) == [(0, 8), (8, 4), (12, 1)] and a.num_unassigned_blocks == 0


def test_extents_are_consecutive_ids_aligned_to_their_size():
    a = BuddyAllocator(num_blocks=32, block_size=2)
    for n in (3, 1, 5, 2, 7):
        ids = a.allocate_blocks(n)
        assert ids == list(range(ids[0], ids[0] + n))
        assert ids[0] % (1 << order_of(n)) == 0
        assert all(a.refcount(b) == 1 for b in ids)


def test_rounding_counts_as_unassigned_blocks():
    a = BuddyAllocator(num_blocks=16, block_size=4)
    ids = a.allocate_blocks(5)  # an 8-block extent
    assert ids == [0, 1, 2, 3, 4]
    assert a.num_free_blocks == 8 and a.num_unassigned_blocks == 3
    assert all(a.refcount(b) == 0 for b in (5, 6, 7))
    a.allocate_blocks(3)  # a 4-block extent: one more unassigned
    assert a.num_unassigned_blocks == 4 and a.num_free_blocks == 4


def test_an_extent_returns_to_the_pool_only_when_all_its_blocks_are_freed():
    a = BuddyAllocator(num_blocks=8, block_size=4)
    ids = a.allocate_blocks(3)  # 4-block extent, 1 unassigned
    a.incref(ids[1])
    a.free(ids[0])
    assert a.refcount(ids[0]) == 0
    # the freed block is not allocatable: it waits, unassigned, for the rest of its extent
    assert a.num_free_blocks == 4 and a.num_unassigned_blocks == 2
    a.free(ids[1])
    assert a.refcount(ids[1]) == 1 and a.num_unassigned_blocks == 2  # still referenced once
    a.free(ids[2])
    assert a.num_free_blocks == 4 and a.num_unassigned_blocks == 3
    a.free(ids[1])
    assert a.num_free_blocks == 8 and a.num_unassigned_blocks == 0 and free_chunks(a) == [(0, 8)]


def test_stranded_free_blocks_are_chunks_too_small_for_the_request():
    a = BuddyAllocator(num_blocks=16, block_size=4)
    singles = [a.allocate_blocks(1)[0] for _ in range(16)]
    for block_id in singles[::2]:  # free every other block: 8 free, none adjacent to a free buddy
        a.free(block_id)
    assert a.num_free_blocks == 8 and len(free_chunks(a)) == 8
    assert a.num_stranded_free_blocks(1) == 0
    assert a.num_stranded_free_blocks(2) == 8
    assert a.num_stranded_free_blocks(8) == 8
    # external fragmentation: half the pool is free, yet no 2-block extent fits
    assert not a.can_allocate_blocks(2)
    with pytest.raises(NoFreeBlocksError, match="contiguous"):
        a.allocate_blocks(2)
    a.free(singles[1])  # 0 and 1 merge, then with nothing else
    assert (0, 2) in free_chunks(a)
    assert a.num_stranded_free_blocks(2) == 7 and a.num_stranded_free_blocks(3) == 9
    assert a.allocate_blocks(2) == [0, 1]


def test_paged_allocators_strand_nothing():
    for cls in (NaiveAllocator, PrefixCachingAllocator):
        a = cls(num_blocks=8, block_size=4)
        ids = [a.allocate() for _ in range(8)]
        for block_id in ids[::2]:
            a.free(block_id)
        assert a.num_stranded_free_blocks(4) == 0 and a.num_unassigned_blocks == 0
        assert a.can_allocate_blocks(4) and not a.can_allocate_blocks(5)
        assert a.max_allocation == 8 and not a.contiguous


def test_buddy_double_free_raises():
    a = BuddyAllocator(num_blocks=4, block_size=4)
    ids = a.allocate_blocks(2)
    a.free(ids[0])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(ids[0])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(3)  # never handed out
    a.free(ids[1])
    with pytest.raises(RuntimeError, match="double free"):
        a.free(ids[1])
    assert a.num_free_blocks == 4 and free_chunks(a) == [(0, 4)]


def test_buddy_allocate_hands_out_one_block_extents_and_zero_blocks_always_fit():
    a = BuddyAllocator(num_blocks=2, block_size=4)
    assert a.allocate() == 0 and a.allocate() == 1
    with pytest.raises(NoFreeBlocksError):
        a.allocate()
    assert a.can_allocate_blocks(0)  # a full pool can still give nothing
    assert a.contiguous and a.supports_swap


# -- reservations ----------------------------------------------------------------------------------


def test_up_front_reservations_admission_slots():
    seq = make_request(10, 25).seqs[0]
    assert final_length(seq.request, None) == 35 and final_length(seq.request, 20) == 20
    assert ExactReservation().admission_slots(seq) == 10
    assert MaxReservation(64).admission_slots(seq) == 64
    assert Pow2Reservation(64).admission_slots(seq) == 10 + 32  # "32 positions for an output of 25"
    assert OracleReservation(64).admission_slots(seq) == 35
    for reservation in (MaxReservation(64), Pow2Reservation(64), OracleReservation(64)):
        assert reservation.growth_slots(seq) == reservation.admission_slots(seq)


def test_reservations_are_capped_at_max_model_len():
    seq = make_request(10, 25).seqs[0]
    assert MaxReservation(30).admission_slots(seq) == 30
    assert Pow2Reservation(40).admission_slots(seq) == 40  # 42 capped
    assert OracleReservation(30).admission_slots(seq) == 30
    # an output already capped by max_model_len: 10 + next_pow2(30 - 10 = 20) = 42, capped at 30
    assert Pow2Reservation(30).admission_slots(seq) == 30


def test_pow2_reservation_small_outputs():
    # outputs of 1, 2, 3, 5 tokens reserve 1, 2, 4, 8 slots past the prompt
    for output, reserved in ((1, 1), (2, 2), (3, 4), (4, 4), (5, 8)):
        assert Pow2Reservation(1000).admission_slots(make_request(7, output).seqs[0]) == 7 + reserved


def test_reservations_never_cover_fewer_slots_than_the_tokens():
    seq = make_request(10, 5).seqs[0]
    seq.token_ids.extend(range(10))  # past its own final length (e.g. recomputed after a change)
    for reservation in (MaxReservation(16), Pow2Reservation(16), OracleReservation(16), ExactReservation()):
        assert reservation.admission_slots(seq) == 20


def test_up_front_reservations_need_a_positive_max_model_len():
    for cls in (MaxReservation, Pow2Reservation, OracleReservation):
        for bad in (0, -3, True, 2.5, None):
            with pytest.raises(ValueError, match="max_model_len"):
                cls(bad)


def test_oracle_rejects_requests_that_eos_can_cut_short():
    request = make_request(4, 8, ignore_eos=False)
    assert "ignore_eos" in OracleReservation(32).rejection(request)
    assert OracleReservation(32).rejection(make_request(4, 8)) is None
    assert OracleReservation.needs_output_lengths and not MaxReservation.needs_output_lengths
    for reservation in (ExactReservation(), MaxReservation(32), Pow2Reservation(32)):
        assert reservation.rejection(request) is None
    bm = BlockManager(BuddyAllocator(16, 4), 0.0, OracleReservation(32), max_model_len=32)
    assert "ignore_eos" in bm.rejection(request)
    assert bm.rejection(make_request(4, 8)) is None


def test_contiguous_allocators_reject_parallel_samples():
    request = make_request(4, 8, n=2)
    assert "best_of=2" in BlockManager(BuddyAllocator(16, 4), 0.0).rejection(request)
    assert BlockManager(NaiveAllocator(16, 4), 0.0).rejection(request) is None


# -- block manager with the baselines ------------------------------------------------------------


def test_orca_max_admits_one_extent_and_reports_reservation_and_fragmentation():
    # 16 blocks of 4 slots; max_model_len 20 -> 5 blocks reserved, rounded to an 8-block extent
    bm = BlockManager(BuddyAllocator(16, 4), 0.0, MaxReservation(20), max_model_len=20)
    seq = make_request(6, 4).seqs[0]  # final length 10: fills 9 slots, the 10th token is never written
    assert bm.admission_blocks(seq) == 5 and bm.can_allocate(seq) is AllocStatus.OK
    seq.num_computed_tokens = bm.allocate(seq)
    assert bm.block_table(seq) == [0, 1, 2, 3, 4]
    s = bm.stats()
    assert (s.num_allocated_blocks, s.num_unassigned_blocks, s.num_free_blocks) == (8, 3, 8)
    assert (s.num_token_slots_used, s.num_reserved_slots) == (6, 3)
    assert s.num_internal_frag_slots == 5 * 4 - 6 - 3
    assert s.breakdown() == {
        "token_state": 6 / 64, "reserved": 3 / 64, "internal_frag": 11 / 64, "external_frag": 12 / 64,
        "free": 32 / 64,
    }
    # the decode steps fill the reservation without taking blocks
    assert bm.try_append_slots(seq) == []
    seq.num_computed_tokens = 6
    for token in range(3):
        seq.token_ids.append(token)
        assert bm.try_append_slots(seq) == []
        seq.num_computed_tokens = seq.num_tokens
    assert len(bm.block_table(seq)) == 5 and bm.stats().num_reserved_slots == 0
    assert bm.stats().num_token_slots_used == 9
    # a waiting request for 9 blocks (a 16-block extent) finds the free 8-block chunk stranded
    assert bm.stats(9).num_stranded_free_blocks == 8
    assert bm.stats(9).breakdown()["external_frag"] == (3 + 8) * 4 / 64
    assert bm.stats(5).num_stranded_free_blocks == 0  # 5 blocks fit the free 8-block chunk
    bm.free(seq)
    s = bm.stats()
    assert (s.num_allocated_blocks, s.num_token_slots_used, s.num_reserved_slots, s.num_unassigned_blocks) == (
        0, 0, 0, 0)


def test_admission_is_never_when_the_reservation_exceeds_the_largest_extent():
    bm = BlockManager(BuddyAllocator(13, 1), 0.0, MaxReservation(9), max_model_len=9)
    assert bm.can_allocate(make_request(2, 4).seqs[0]) is AllocStatus.NEVER  # 9 > max_allocation 8
    bm = BlockManager(BuddyAllocator(13, 1), 0.0, OracleReservation(9), max_model_len=9)
    assert bm.can_allocate(make_request(2, 6).seqs[0]) is AllocStatus.OK


def test_admission_waits_on_external_fragmentation():
    bm = BlockManager(BuddyAllocator(8, 1), 0.0)
    seqs = [make_request(1, 4).seqs[0] for _ in range(8)]
    for seq in seqs:
        seq.num_computed_tokens = bm.allocate(seq)
    for seq in seqs[::2]:
        bm.free(seq)
    waiting = make_request(2, 4).seqs[0]
    assert bm.allocator.num_free_blocks == 4
    assert bm.can_allocate(waiting) is AllocStatus.LATER
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(waiting)
    s = bm.stats(bm.admission_blocks(waiting))
    assert s.num_stranded_free_blocks == 4 and s.breakdown()["external_frag"] == 4 / 8
    assert s.breakdown()["free"] == 0.0


def test_can_append_slots_agrees_with_try_append_slots_on_fragmented_buddy_pool():
    """Growth by two blocks on a buddy pool whose two free blocks are not buddies."""
    bm = BlockManager(BuddyAllocator(4, 1), 0.0)
    seqs = [make_request(1, 8).seqs[0] for _ in range(3)]
    for seq in seqs:
        seq.num_computed_tokens = bm.allocate(seq)
    bm.free(seqs[1])
    a = seqs[0]
    a.num_computed_tokens = 1
    a.token_ids += [2, 3]
    assert bm.can_append_slots(a) == (bm.try_append_slots(a) is not None)


def test_sliding_window_of_one_token_keeps_the_books_of_dropped_blocks_closed():
    """Window 1: the decode step at a block boundary drops every block before it; the slow path
    must not re-account the old last block, which it has just released."""
    bm = BlockManager(PrefixCachingAllocator(4, 2), 0.0, sliding_window=1)
    seq = make_request(4, 8).seqs[0]
    seq.num_computed_tokens = bm.allocate(seq)
    assert bm.try_append_slots(seq) == []
    seq.num_computed_tokens = 4
    bm.mark_computed(seq)  # blocks 0 and 1 are published: freed, they stay cached at the queue's tail
    seq.token_ids.append(5)
    assert bm.try_append_slots(seq) == []
    assert bm._seqs[seq.seq_id].num_dropped == 2
    s = bm.stats()
    assert s.num_allocated_blocks == 1
    assert s.num_token_slots_used == 1 and s.num_internal_frag_slots >= 0
    bm.free(seq)
    s = bm.stats()
    assert s.num_token_slots_used == 0 and s.num_reserved_slots == 0


# -- random interleavings --------------------------------------------------------------------------

# (allocator, reservation): paged allocation, and the buddy allocator under every reservation
COMBOS = [
    (NaiveAllocator, "exact"),
    (PrefixCachingAllocator, "exact"),
    (BuddyAllocator, "exact"),
    (BuddyAllocator, "max"),
    (BuddyAllocator, "pow2"),
    (BuddyAllocator, "oracle"),
]
RESERVATIONS = {"max": MaxReservation, "pow2": Pow2Reservation, "oracle": OracleReservation}


def expected_slots(kind: str, seq: Sequence, max_model_len: int) -> int:
    """What the reservation should cover for `seq`, worked out independently."""
    prompt, max_tokens = seq.request.num_prompt_tokens, seq.request.params.max_tokens
    final = min(prompt + max_tokens, max_model_len)
    if kind == "exact":
        return seq.num_tokens
    if kind == "max":
        reserve = max_model_len
    elif kind == "oracle":
        reserve = final
    else:
        output, power = final - prompt, 1
        while power < output:
            power *= 2
        reserve = prompt + power
    return max(seq.num_tokens, min(reserve, max_model_len))


class MemoryBreakdownMachine(RuleBasedStateMachine):
    """An engine over a BlockManager, with a model of device and CPU KV contents.

    `kv[block][slot]` is what the executor wrote there: the tokens up to that position (prefix
    hits and forks share blocks only between sequences that agree on them). Sequences finish at
    their final length (ignore_eos), are preempted by recompute or swapped out to the CPU pool
    and back, and with a sliding window lose the blocks that no later query attends to.
    """

    @initialize(
        # the paged pairings drawn as often as all buddy ones together: only they fork and slide
        combo=st.one_of(st.sampled_from(COMBOS[:2]), st.sampled_from(COMBOS[2:])),
        num_blocks=st.integers(1, 24),
        block_size=st.sampled_from([1, 2, 4]),
        watermark=st.sampled_from([0.0, 0.0, 0.1]),
        max_model_len=st.integers(2, 48),
        num_cpu_blocks=st.integers(0, 8),
        # small windows (down to one token) drop blocks every few steps
        sliding_window=st.one_of(st.none(), st.sampled_from([1, 2, 3]), st.integers(1, 12)),
    )
    def setup(self, combo, num_blocks, block_size, watermark, max_model_len, num_cpu_blocks, sliding_window):
        cls, self.kind = combo
        reservation = ExactReservation() if self.kind == "exact" else RESERVATIONS[self.kind](max_model_len)
        self.bm = BlockManager(
            cls(num_blocks=num_blocks, block_size=block_size), watermark, reservation,
            max_model_len=max_model_len, num_cpu_blocks=num_cpu_blocks, sliding_window=sliding_window,
        )
        self.alloc = self.bm.allocator
        self.cpu = self.bm.cpu_allocator
        assert (self.cpu is None) == (num_cpu_blocks == 0)
        self.n, self.bs, self.mml, self.num_cpu = num_blocks, block_size, max_model_len, num_cpu_blocks
        # the manager ignores the window for contiguous allocators: an extent is kept whole
        self.window = None if self.alloc.contiguous else sliding_window
        assert self.bm.sliding_window == self.window
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.kv: dict[int, list] = {b: [None] * block_size for b in range(num_blocks)}
        self.cpu_kv: dict[int, list] = {b: [None] * block_size for b in range(num_cpu_blocks)}
        self.covered: dict[int, int] = {}  # seq id -> slots filled (num_tokens at the last growth)
        self.dropped: dict[int, int] = {}  # seq id -> leading blocks dropped by the window
        self.prefilled: set[int] = set()  # seq ids that ran a step since admission / swap in
        self.swap_out_blocks: dict[int, tuple[list[int], list[int]]] = {}  # seq id -> (stale, cpu)
        self.num_requests = 0

    # -- helpers

    @staticmethod
    def value(seq: Sequence, pos: int) -> tuple:
        return tuple(seq.token_ids[: pos + 1])

    def final(self, seq: Sequence) -> int:
        return final_length(seq.request, self.mml)

    def live(self, seq: Sequence) -> list[int]:
        return self.bm.block_table(seq)[self.dropped[seq.seq_id] :]

    def refs(self) -> list[int]:
        refs = [0] * self.n
        for seq in self.running:
            for b in self.live(seq):
                refs[b] += 1
        return refs

    def expect_status(self, required: int) -> AllocStatus:
        """The status of taking `required` fresh blocks (as one extent, if the allocator must)."""
        wm = self.bm.watermark_blocks
        if required > self.alloc.max_allocation or self.n - required < wm:
            return AllocStatus.NEVER
        if self.alloc.num_free_blocks - required >= wm and self.alloc.can_allocate_blocks(required):
            return AllocStatus.OK
        return AllocStatus.LATER

    def window_start(self, seq: Sequence) -> int:
        """The first position the next query of `seq` attends to."""
        if self.window is None:
            return 0
        return max(seq.num_computed_tokens - self.window + 1, 0)

    # -- rules

    @precondition(lambda self: len(self.waiting) < 4)
    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=20), max_tokens=st.integers(1, 20))
    def add(self, prompt, max_tokens):
        prompt = prompt[: self.mml - 1]  # the engine refuses prompts with no room for an output
        self.num_requests += 1
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        request = Request(f"r{self.num_requests}", prompt, params)
        assert self.bm.rejection(request) is None
        eos = Request("eos", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        assert (self.bm.rejection(eos) is not None) == (self.kind == "oracle")
        parallel = Request("n2", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=2, temperature=0.0))
        assert (self.bm.rejection(parallel) is not None) == self.alloc.contiguous
        self.waiting.append(request.seqs[0])

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        seq = data.draw(st.sampled_from(self.waiting))
        required = cdiv(expected_slots(self.kind, seq, self.mml), self.bs)
        assert self.bm.admission_blocks(seq) == required
        status = self.bm.can_allocate(seq)
        expected = self.expect_status(required)
        if self.alloc.caches_prefixes and expected is AllocStatus.LATER:
            assert status in (AllocStatus.OK, AllocStatus.LATER)  # prefix hits need fewer blocks
        else:
            assert status is expected
        if status is AllocStatus.NEVER:  # the scheduler aborts it
            self.waiting.remove(seq)
            assert not self.bm.has_blocks(seq)
            return
        if status is not AllocStatus.OK:
            if not self.alloc.caches_prefixes and not (
                required <= self.alloc.num_free_blocks and self.alloc.can_allocate_blocks(required)
            ):
                with pytest.raises(NoFreeBlocksError):
                    self.bm.allocate(seq)
                assert not self.bm.has_blocks(seq)
            return
        hit = self.bm.allocate(seq)
        assert hit % self.bs == 0 and 0 <= hit < seq.num_tokens
        assert hit == 0 or self.alloc.caches_prefixes
        seq.num_computed_tokens = hit
        table = self.bm.block_table(seq)
        assert len(table) == required
        if self.alloc.contiguous:
            assert table == list(range(table[0], table[0] + required)), "not one extent"
        self.covered[seq.seq_id] = seq.num_tokens
        self.dropped[seq.seq_id] = 0
        self.waiting.remove(seq)
        self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 1))
    def step(self, data, token):
        """Schedule `seq` (grow its table), compute its new positions and sample one token."""
        seq = data.draw(st.sampled_from(self.running))
        bs, sid = self.bs, seq.seq_id
        before = list(self.bm.block_table(seq))
        dropped = self.dropped[sid]
        if self.window is not None:
            dead = min((seq.num_computed_tokens - self.window + 1) // bs, len(before))
            dropped = max(dropped, dead)
        covered_slots = max(seq.num_tokens, expected_slots(self.kind, seq, self.mml))
        num_new = max(cdiv(covered_slots, bs) - len(before), 0)
        refcount = self.alloc.refcount
        shared = [i for i in range(seq.num_computed_tokens // bs, min(cdiv(seq.num_tokens, bs), len(before)))
                  if refcount(before[i]) > 1]
        copies = self.bm.try_append_slots(seq)
        # blocks wholly before the step's window are dropped whether or not the step fits
        assert self.bm._seqs[sid].num_dropped == dropped
        self.dropped[sid] = dropped
        table = self.bm.block_table(seq)
        if copies is None:
            assert table == before
            fits = num_new + len(shared) <= self.alloc.num_free_blocks and self.alloc.can_allocate_blocks(num_new)
            assert not fits, "try_append_slots refused a step that fits"
            return
        assert len(table) == len(before) + num_new
        # copy-on-write of exactly the shared blocks the step writes, in table order
        assert [(before[i], table[i]) for i in shared] == copies
        for src, dst in copies:
            assert refcount(dst) == 1
            self.kv[dst] = list(self.kv[src])
        if self.alloc.contiguous and num_new:
            assert table[len(before) :] == list(range(table[len(before)], table[len(before)] + num_new))
        self.covered[sid] = seq.num_tokens
        if self.window is not None:
            uncomputed = cdiv(seq.num_tokens, bs) - seq.num_computed_tokens // bs
            assert len(table) - dropped <= cdiv(self.window, bs) + 1 + uncomputed
        for pos in range(seq.num_computed_tokens, seq.num_tokens):
            block_id = table[pos // bs]
            assert pos // bs >= dropped and refcount(block_id) == 1, "write into a dropped or shared block"
            self.kv[block_id][pos % bs] = self.value(seq, pos)
        seq.num_computed_tokens = seq.num_tokens
        self.bm.mark_computed(seq)
        self.prefilled.add(sid)
        seq.token_ids.append(token)
        if seq.num_tokens >= self.final(seq):  # finished: its last token is never written
            assert seq.num_tokens == self.final(seq)
            self.bm.free(seq)
            assert not self.bm.has_blocks(seq)
            self.running.remove(seq)

    @precondition(lambda self: self.running and len(self.running) < 8 and not self.alloc.contiguous)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.running))
        child = parent.fork(1)
        self.bm.fork(parent, child)
        assert self.bm.block_table(child) == self.bm.block_table(parent)
        assert self.bm.block_table(child) is not self.bm.block_table(parent)
        for key in ("covered", "dropped"):
            getattr(self, key)[child.seq_id] = getattr(self, key)[parent.seq_id]
        if parent.seq_id in self.prefilled:
            self.prefilled.add(child.seq_id)
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_by_recompute(self, data):
        seq = data.draw(st.sampled_from(self.running))
        self.bm.free(seq)
        assert not self.bm.has_blocks(seq)
        seq.num_computed_tokens = 0
        self.prefilled.discard(seq.seq_id)
        self.running.remove(seq)
        self.waiting.append(seq)

    @precondition(lambda self: self.cpu is not None and any(s.seq_id in self.prefilled for s in self.running))
    @rule(data=st.data())
    def swap_out(self, data):
        # the scheduler preempts decoding sequences: the last token is sampled, not yet computed
        seq = data.draw(st.sampled_from([s for s in self.running if s.seq_id in self.prefilled]))
        sid = seq.seq_id
        assert seq.num_computed_tokens == seq.num_tokens - 1 == self.covered[sid]
        table = list(self.bm.block_table(seq))
        moved = table[self.dropped[sid] : cdiv(self.covered[sid], self.bs)]
        can = self.bm.can_swap_out(seq)
        assert can == (len(moved) <= self.cpu.num_free_blocks)
        if not can:
            return
        pairs = self.bm.swap_out(seq)
        assert [device for device, _ in pairs] == moved
        for device, cpu in pairs:
            self.cpu_kv[cpu] = list(self.kv[device])
        assert self.bm.is_swapped(seq) and self.bm.has_blocks(seq)
        self.swap_out_blocks[sid] = (table[: self.dropped[sid]], [cpu for _, cpu in pairs])
        self.prefilled.discard(sid)
        self.running.remove(seq)
        self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq = data.draw(st.sampled_from(self.swapped))
        sid = seq.seq_id
        stale, cpu_blocks = self.swap_out_blocks[sid]
        required = cdiv(expected_slots(self.kind, seq, self.mml), self.bs) - len(stale)
        status = self.bm.can_swap_in(seq)
        assert status is self.expect_status(required)
        if status is AllocStatus.NEVER:  # the scheduler aborts it
            self.bm.free(seq)
            assert not self.bm.has_blocks(seq) and not self.bm.is_swapped(seq)
            del self.swap_out_blocks[sid]
            self.swapped.remove(seq)
            return
        if status is not AllocStatus.OK:
            with pytest.raises(NoFreeBlocksError):
                self.bm.swap_in(seq)
            assert self.bm.is_swapped(seq)
            return
        pairs = self.bm.swap_in(seq)
        table = self.bm.block_table(seq)
        assert table[: len(stale)] == stale and len(table) == len(stale) + required
        if self.alloc.contiguous:
            assert table == list(range(table[0], table[0] + required)), "not one extent"
        assert pairs == list(zip(cpu_blocks, table[len(stale) :], strict=False))
        for cpu, device in pairs:
            self.kv[device] = list(self.cpu_kv[cpu])
        assert not self.bm.is_swapped(seq) and self.bm.has_blocks(seq)
        assert seq.num_computed_tokens == seq.num_tokens - 1
        self.covered[sid] = seq.num_tokens  # the table covers the last token for its step
        del self.swap_out_blocks[sid]
        self.swapped.remove(seq)
        self.running.append(seq)

    # -- invariants

    @invariant()
    def no_leak_no_double_use(self):
        refs = self.refs()
        for seq in self.running:
            assert self.bm._seqs[seq.seq_id].num_dropped == self.dropped[seq.seq_id]
        for seq in self.waiting:
            assert not self.bm.has_blocks(seq)
        assert [self.alloc.refcount(b) for b in range(self.n)] == refs
        unreferenced = {b for b in range(self.n) if refs[b] == 0}
        if isinstance(self.alloc, BuddyAllocator):
            free_ids = [b for start, size in free_chunks(self.alloc) for b in range(start, start + size)]
            assert len(unreferenced) == self.alloc.num_free_blocks + self.alloc.num_unassigned_blocks
        else:
            free_ids = list(self.alloc.free_ids()) if isinstance(self.alloc, NaiveAllocator) else [
                *self.alloc._hashless, *(b for b in range(self.alloc.num_blocks) if b in self.alloc.eviction)]
            assert self.alloc.num_unassigned_blocks == 0 and set(free_ids) == unreferenced
        assert len(free_ids) == len(set(free_ids)) == self.alloc.num_free_blocks
        assert set(free_ids) <= unreferenced, "a block is both free and referenced"
        if self.cpu is not None:
            cpu_refs = [0] * self.num_cpu
            for seq in self.swapped:
                assert self.bm.is_swapped(seq)
                for b in self.swap_out_blocks[seq.seq_id][1]:
                    cpu_refs[b] += 1
            assert [self.cpu.refcount(b) for b in range(self.num_cpu)] == cpu_refs
            assert sorted(self.cpu.free_ids()) == [b for b in range(self.num_cpu) if cpu_refs[b] == 0]

    @invariant()
    def sequences_read_their_own_kv(self):
        bs = self.bs
        for seq in self.running:
            table, dropped = self.bm.block_table(seq), self.dropped[seq.seq_id]
            for pos in range(self.window_start(seq), seq.num_computed_tokens):
                assert pos // bs >= dropped, "a position in the window was dropped"
                assert self.kv[table[pos // bs]][pos % bs] == self.value(seq, pos)
        for seq in self.swapped:
            stale, cpu_blocks = self.swap_out_blocks[seq.seq_id]
            for pos in range(self.window_start(seq), seq.num_computed_tokens):
                assert pos // bs >= len(stale), "a position in the window was dropped"
                assert self.cpu_kv[cpu_blocks[pos // bs - len(stale)]][pos % bs] == self.value(seq, pos)

    @invariant()
    def stats_match_a_recount(self):
        bs = self.bs
        fill: dict[int, int] = {}
        future: dict[int, int] = {}
        will_fill = 0
        for seq in self.running:
            covered, last = self.covered[seq.seq_id], self.final(seq) - 1  # the last token is never written
            will_fill += max(last - covered, 0)
            table = self.bm.block_table(seq)
            for i in range(self.dropped[seq.seq_id], len(table)):
                f = min(bs, max(covered - i * bs, 0))
                cap = min(max(last - i * bs, 0), bs)
                assert fill.setdefault(table[i], f) == f, "sharers disagree on a block's fill"
                future[table[i]] = max(cap - f, 0)
        s = self.bm.stats()
        referenced = sum(1 for r in self.refs() if r)
        assert s.num_allocated_blocks == referenced + s.num_unassigned_blocks
        assert s.num_allocated_blocks + s.num_free_blocks == s.num_total_blocks == self.n
        assert s.num_token_slots_used == sum(fill.values())
        assert s.num_reserved_slots == sum(future.values())
        assert s.num_reserved_slots <= will_fill
        assert s.num_cpu_blocks == self.num_cpu
        assert s.num_free_cpu_blocks == (self.cpu.num_free_blocks if self.cpu else 0)

    @invariant()
    def breakdown_sums_to_one(self):
        waiting = {self.bm.admission_blocks(seq) for seq in self.waiting}
        for blocked in sorted({0, 1, 2, 3, self.alloc.max_allocation, *waiting}):
            s = self.bm.stats(blocked)
            assert s.num_internal_frag_slots >= 0
            if isinstance(self.alloc, BuddyAllocator) and blocked:
                small = [size for _, size in free_chunks(self.alloc) if size < 1 << order_of(blocked)]
                assert s.num_stranded_free_blocks == sum(small)
            else:
                assert s.num_stranded_free_blocks == 0
            shares = s.breakdown()
            assert all(0.0 <= v <= 1.0 for v in shares.values()), shares
            assert abs(sum(shares.values()) - 1.0) <= 1e-9, shares

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in self.running + self.swapped:
            self.bm.free(seq)
            assert not self.bm.has_blocks(seq)
        s = self.bm.stats()
        assert (s.num_allocated_blocks, s.num_free_blocks) == (0, self.n)
        assert (s.num_token_slots_used, s.num_reserved_slots, s.num_unassigned_blocks) == (0, 0, 0)
        assert all(self.alloc.refcount(b) == 0 for b in range(self.n))
        assert s.num_free_cpu_blocks == self.num_cpu
        if self.cpu is not None:
            assert all(self.cpu.refcount(b) == 0 for b in range(self.num_cpu))
        assert self.alloc.can_allocate_blocks(self.alloc.max_allocation)


MemoryBreakdownMachine.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)
TestMemoryBreakdownMachine = MemoryBreakdownMachine.TestCase
