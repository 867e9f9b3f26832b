"""A fast-forward window's step statistics read the cache as a `DecodeKV` of the block manager's
counts (`window_steps._decode_kv`), not a `KVStats`: the same step, to the bit, as `decode_step`
of `BlockManager.stats()`, with blocks shared (forks), rounded up (the buddy allocator) or free."""

from __future__ import annotations

import pytest

from paged.engine.step_stats import DecodeKV, decode_step
from paged.engine.window_steps import _decode_kv
from paged.memory import BlockManager, BuddyAllocator, NaiveAllocator, PrefixCachingAllocator
from paged.request import Request, SamplingParams


@pytest.mark.parametrize("cls", [NaiveAllocator, PrefixCachingAllocator, BuddyAllocator])
def test_decode_kv_is_decode_step_of_stats(cls):
    bm = BlockManager(cls(num_blocks=64, block_size=4), 0.0)
    seqs = [Request(f"r{i}", list(range(3 + 5 * i)), SamplingParams(temperature=0.0)).seqs[0] for i in range(4)]
    for seq in seqs:
        seq.num_computed_tokens = bm.allocate(seq)
        seq.num_computed_tokens = seq.num_tokens
        bm.mark_computed(seq)
    child = Request("c", [0], SamplingParams(temperature=0.0)).seqs[0]
    bm.fork(seqs[3], child)  # shared blocks: more logical blocks than held
    steps = 0
    for kv in (_decode_kv(bm), DecodeKV.of(bm.stats())):
        for used, reserved in ((0, 0), (40, 3), (bm.ledger.num_used, bm.ledger.num_reserved)):
            got = kv.step(5, 0.0125, "v2", used, reserved, 1.5, 1.5625)
            expected = decode_step(5, 0.0125, "v2", bm.stats(), used, reserved, 1.5, 1.5625)
            assert repr(got) == repr(expected)
            steps += 1
        assert kv.num_free_blocks == bm.stats().num_free_blocks
    assert bm.stats().num_logical_blocks > bm.stats().num_allocated_blocks - bm.stats().num_unassigned_blocks
    assert steps == 6
