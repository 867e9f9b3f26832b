"""A model stand-in that keeps token ids in a paged cache and reads its context back through the
block tables, so any block-management bug (a wrong prefix hit, a missed copy-on-write, a block
reused while still referenced, a block swapped to or from the wrong place) changes its outputs.
Scheduler and engine tests use it where the real model would only make them slower."""

from __future__ import annotations

import time

import numpy as np

from paged.executor.base import Executor, KVCacheSpec
from paged.step import ExecutorOutput, SchedulerOutput

VOCAB = 1000


class TokenCacheExecutor(Executor):
    """Samples ids below `vocab_size - 1` (never its EOS, the last id) from a hash of the context."""

    kernel_description = "token-cache test executor"
    supports_swap = True

    def __init__(self, vocab_size: int = VOCAB) -> None:
        self.vocab_size = vocab_size
        # the ids it samples among; a subclass may take a wider vocabulary in its prompts
        self.num_sampled_ids = vocab_size
        self.eos_token_ids = frozenset([vocab_size - 1])
        self.cache = np.zeros((0, 0), dtype=np.int64)
        self.num_computed_tokens = 0

    @property
    def description(self) -> str:
        return "token-cache test executor"

    def kv_cache_spec(self, block_size: int) -> KVCacheSpec:
        return KVCacheSpec(block_size, 8 * block_size, "int64 token ids [blocks, block_size]")

    def init_kv_cache(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0) -> None:
        self.cache = np.full((num_blocks, block_size), -1, dtype=np.int64)
        # by block: at 8 bytes a token, the default 4 GiB swap space is 33M blocks, and a dense array
        # took ~2 s to fill per engine; a block never swapped out reads as unwritten (-1)
        self.cpu_cache: dict[int, np.ndarray] = {}
        self.num_cpu_blocks = num_cpu_blocks
        self.block_size = block_size

    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        start = time.perf_counter()
        for device, cpu in sched.blocks_to_swap_out:
            assert 0 <= cpu < self.num_cpu_blocks, f"swap-out to CPU block {cpu} of {self.num_cpu_blocks}"
            self.cpu_cache[cpu] = self.cache[device].copy()
        for cpu, device in sched.blocks_to_swap_in:
            assert 0 <= cpu < self.num_cpu_blocks, f"swap-in from CPU block {cpu} of {self.num_cpu_blocks}"
            self.cache[device] = self.cpu_cache.get(cpu, -1)
        for src, dst in sched.blocks_to_copy:
            self.cache[dst] = self.cache[src]
        bs = self.block_size
        sampled = []
        for item in sched.scheduled:
            seq, table = item.seq, item.block_table
            for pos in range(item.num_computed, item.context_len):
                self.cache[table[pos // bs], pos % bs] = seq.token_ids[pos]
            self.num_computed_tokens += item.num_new_tokens
            context = [int(self.cache[table[p // bs], p % bs]) for p in range(item.context_len)]
            base = (sum(t * (i + 1) for i, t in enumerate(context)) * 7919 + seq.index) % (self.num_sampled_ids - 1)
            sampled.append([(base + k * 13) % (self.num_sampled_ids - 1) for k in range(item.num_samples)])
        return ExecutorOutput(sampled, sched.num_batched_tokens, time.perf_counter() - start)
