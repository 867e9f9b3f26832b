"""A model stand-in that keeps token ids in a paged cache and reads its context back through the
block tables, so any block-management bug (a wrong prefix hit, a missed copy-on-write, a block
reused while still referenced) changes its outputs. Scheduler and engine tests use it where the
real model would only make them slower."""

from __future__ import annotations

import time

import numpy as np

from paged.executor.base import ExecutorOutput
from paged.scheduler.output import SchedulerOutput

VOCAB = 1000
EOS = 999


class TokenCacheExecutor:
    eos_token_id = EOS
    kernel_description = "token-cache test executor"

    def __init__(self) -> None:
        self.cache = np.zeros((0, 0), dtype=np.int64)
        self.num_computed_tokens = 0
        self.tokenizer = None

    def bytes_per_block(self, block_size: int) -> int:
        return 8 * block_size

    def init_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.cache = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.block_size = block_size

    def execute(self, sched: SchedulerOutput) -> ExecutorOutput:
        start = time.perf_counter()
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
            base = (sum(t * (i + 1) for i, t in enumerate(context)) * 7919 + seq.index) % (VOCAB - 1)
            sampled.append([(base + k * 13) % (VOCAB - 1) for k in range(item.num_samples)])
        return ExecutorOutput(sampled, sched.num_batched_tokens, time.perf_counter() - start)
