"""Prefix-cache hit rate of every eviction policy on a skewed-reuse request stream, replayed on the
block manager and the prefix-caching allocator alone (no model, no scheduler, no timing).

    python experiments/studies/eviction_bench.py [--prefixes 64] [--prefix-blocks 8] [--requests 4000] [--seeds 3]

Each request is one of `--prefixes` shared prefixes of `--prefix-blocks` full blocks, picked by a Zipf
law (probability of the k-th most popular ~ 1 / k^s, s = `--zipf-s`, 1.0 by default), followed by a
suffix of its own (`--suffix-blocks` full blocks and a partial one, never reused: what a user's own
question adds). `--concurrency` requests hold their blocks at once; the oldest finishes (frees its
table, last block first) when the next one is admitted. The pool holds a quarter of the prefixes'
blocks (`--pool-fraction`), the running requests' blocks included. Hit rate = prompt tokens found in
the cache / prompt tokens looked up, as summary.json's prefix_cache_hit_rate; the table shows the mean
over `--seeds` streams and its range. Every policy replays the same streams.
"""

from __future__ import annotations

import argparse
import statistics
from collections import deque

import numpy as np
from rich.console import Console
from rich.table import Table

from paged.memory import AllocStatus, BlockManager, PrefixCachingAllocator
from paged.memory.eviction import POLICIES
from paged.request import Request, SamplingParams

BLOCK_SIZE = 16


def request_stream(args: argparse.Namespace, seed: int) -> list[list[int]]:
    """Prompts: a Zipf-chosen shared prefix, then tokens of the request's own."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, args.prefixes + 1) ** args.zipf_s
    picks = rng.choice(args.prefixes, size=args.requests, p=weights / weights.sum())
    prefix_len = args.prefix_blocks * BLOCK_SIZE
    suffix_len = args.suffix_blocks * BLOCK_SIZE + BLOCK_SIZE // 2
    prompts = []
    for i, k in enumerate(picks):
        prefix = [1 + int(k) * prefix_len + j for j in range(prefix_len)]
        own = 10_000_000 + i * suffix_len  # distinct from every prefix token and every other request
        prompts.append(prefix + list(range(own, own + suffix_len)))
    return prompts


def replay(policy_name: str, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, int]:
    """(hit rate, evictions) of one policy on `prompts`."""
    num_blocks = int(args.prefixes * args.prefix_blocks * args.pool_fraction)
    allocator = PrefixCachingAllocator(num_blocks=num_blocks, block_size=BLOCK_SIZE, eviction=POLICIES[policy_name]())
    manager = BlockManager(allocator, watermark=0.0)
    running: deque = deque()
    for i, tokens in enumerate(prompts):
        seq = Request(f"r{i}", tokens, SamplingParams(temperature=0.0)).seqs[0]
        while running and (len(running) >= args.concurrency or manager.can_allocate(seq) is not AllocStatus.OK):
            manager.free(running.popleft())
        manager.allocate(seq)
        seq.num_computed_tokens = seq.num_tokens  # the prompt computed in one step, then published
        manager.mark_computed(seq)
        running.append(seq)
    stats = manager.stats()
    return stats.num_hit_tokens / stats.num_queried_tokens, allocator.num_evictions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefixes", type=int, default=64)
    parser.add_argument("--prefix-blocks", type=int, default=8)
    parser.add_argument("--suffix-blocks", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--zipf-s", type=float, default=1.0)
    parser.add_argument("--pool-fraction", type=float, default=0.25)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    streams = [request_stream(args, seed) for seed in range(args.seeds)]
    rows = {name: [replay(name, prompts, args) for prompts in streams] for name in POLICIES}
    lru = statistics.mean(rate for rate, _ in rows["lru"])
    num_blocks = int(args.prefixes * args.prefix_blocks * args.pool_fraction)
    table = Table(title=(
        f"Prefix-cache hit rate: {args.requests} requests, Zipf s={args.zipf_s} over {args.prefixes} prefixes of "
        f"{args.prefix_blocks} blocks (+{args.suffix_blocks}.5 own), pool {num_blocks} blocks of {BLOCK_SIZE}, "
        f"{args.concurrency} running, {args.seeds} seeds"
    ))
    for column in ("policy", "hit rate (mean)", "min..max", "vs lru", "evictions (mean)"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for name, results in rows.items():
        rates = [rate for rate, _ in results]
        mean = statistics.mean(rates)
        table.add_row(
            name, f"{mean:.4f}", f"{min(rates):.4f}..{max(rates):.4f}", f"{mean - lru:+.4f} ({mean / lru:.3f}x)",
            f"{statistics.mean(n for _, n in results):.0f}",
        )
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
