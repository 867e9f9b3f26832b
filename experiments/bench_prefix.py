"""Prefix caching vs the naive allocator, on SmolLM2-135M on this CPU.

Two workloads of 64 requests each (greedy, ignore_eos): one where every prompt starts with the same
512-token prefix followed by a 32-token unique suffix, and one with 544-token prompts that share
nothing. Each allocator runs both; the table gives output tokens/s, prompt tokens actually
computed and the prefix hit rate. Run:

    python experiments/bench_prefix.py [--num-requests 64] [--prefix-len 512] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import time
from importlib import resources

import numpy as np
from rich.console import Console
from rich.table import Table

from paged import LLM, SamplingParams


def workloads(corpus: list[int], n: int, prefix_len: int, suffix_len: int, seed: int) -> dict[str, list[list[int]]]:
    rng = np.random.default_rng(seed)

    def window(length: int) -> list[int]:
        start = int(rng.integers(len(corpus)))
        return [corpus[(start + i) % len(corpus)] for i in range(length)]

    prefix = window(prefix_len)
    return {
        "shared prefix": [prefix + window(suffix_len) for _ in range(n)],
        "no shared prefix": [[int(rng.integers(1000, 40000))] + window(prefix_len + suffix_len - 1) for _ in range(n)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    overrides = ["scheduler.max_num_seqs=64", "allocator.num_blocks=4096"]
    llms = {name: LLM("smollm2-135m", allocator=name, overrides=overrides) for name in ("naive", "prefix")}
    tokenizer = llms["naive"].executor.tokenizer
    corpus = tokenizer.encode(resources.files("paged.data").joinpath("corpus.txt").read_text())
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    table = Table(title=f"Prefix caching, {args.num_requests} requests, SmolLM2-135M fp32")
    for col in ("workload", "allocator", "time (s)", "output tokens/s", "prompt tokens computed", "hit rate"):
        table.add_column(col)
    results: dict[tuple[str, str], float] = {}
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    for wl_name, prompts in workloads(corpus, args.num_requests, args.prefix_len, args.suffix_len, args.seed).items():
        for name, llm in llms.items():
            executor = llm.executor
            before = executor.num_prefill_tokens_computed
            bm = llm.engine.block_manager
            queried, hits = bm.num_queried_tokens, bm.num_hit_tokens
            start = time.perf_counter()
            out = llm.generate(prompts, params)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.token_ids) for o in out)
            results[(wl_name, name)] = tokens / elapsed
            outputs[(wl_name, name)] = [o.token_ids for o in out]
            q = bm.num_queried_tokens - queried
            hit_rate = f"{(bm.num_hit_tokens - hits) / q:.3f}" if q else "n/a"
            table.add_row(wl_name, name, f"{elapsed:.1f}", f"{tokens / elapsed:.1f}",
                          str(executor.num_prefill_tokens_computed - before), hit_rate)
    console = Console()
    console.print(table)
    for wl_name in ("shared prefix", "no shared prefix"):
        ratio = results[(wl_name, "prefix")] / results[(wl_name, "naive")]
        same = outputs[(wl_name, "prefix")] == outputs[(wl_name, "naive")]
        console.print(f"{wl_name}: prefix / naive throughput = {ratio:.2f}x, identical outputs: {same}")


if __name__ == "__main__":
    main()
