"""Prefix caching vs the naive allocator, on SmolLM2-135M on this CPU.

Two workloads of 64 requests each (greedy, ignore_eos): one where every prompt starts with the same
512-token prefix followed by a 32-token unique suffix, and one with 544-token prompts that share
nothing. Each allocator runs both; the table gives output tokens/s, prompt tokens actually
computed and the prefix hit rate, as the median of cold-cache passes alternating
which allocator goes first. Run:

    python experiments/cpu/bench_prefix.py [--num-requests 64] [--prefix-len 512] [--max-tokens 32] [--repeats 3]
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


def timed_run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One cold-cache pass: the prefix cache is reset first so repeats do not hit each other."""
    assert llm.reset_prefix_cache(), "blocks still referenced before a timed run"
    executor, before = llm.executor, llm.engine.kv_stats()
    computed = executor.num_prefill_tokens_computed
    start = time.perf_counter()
    out = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    after = llm.engine.kv_stats()
    q = after.num_queried_tokens - before.num_queried_tokens
    return {
        "time": elapsed,
        "tokens": sum(len(o.token_ids) for o in out),
        "computed": executor.num_prefill_tokens_computed - computed,
        "hit_rate": (after.num_hit_tokens - before.num_hit_tokens) / q if q else None,
        "outputs": [o.token_ids for o in out],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per cell; the median is reported")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    overrides = ["scheduler.max_num_seqs=64", "allocator.num_blocks=4096"]
    llms = {name: LLM("smollm2-135m", allocator=name, overrides=overrides) for name in ("naive", "prefix")}
    tokenizer = llms["naive"].executor.tokenizer
    corpus = tokenizer.encode(resources.files("paged.data").joinpath("corpus.txt").read_text())
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    suites = workloads(corpus, args.num_requests, args.prefix_len, args.suffix_len, args.seed)
    for llm in llms.values():  # thread pools, allocator warm-up and native kernels are paid here
        llm.generate(suites["no shared prefix"][:8], params)
    table = Table(title=f"Prefix caching, {args.num_requests} requests, SmolLM2-135M fp32, "
                        f"median of {args.repeats} cold-cache passes")
    for col in ("workload", "allocator", "time (s)", "output tokens/s", "prompt tokens computed", "hit rate"):
        table.add_column(col)
    console = Console(width=120)
    summary = []
    for wl_name, prompts in suites.items():
        runs: dict[str, list[dict]] = {name: [] for name in llms}
        for rep in range(args.repeats):
            # Alternating who goes first cancels drift (thermal, page cache) between the two.
            for name in (list(llms) if rep % 2 == 0 else list(reversed(llms))):
                runs[name].append(timed_run(llms[name], prompts, params))
        medians = {}
        for name, results in runs.items():
            med = sorted(results, key=lambda r: r["time"])[len(results) // 2]
            medians[name] = med["tokens"] / med["time"]
            hit = f"{med['hit_rate']:.3f}" if med["hit_rate"] is not None else "n/a"
            table.add_row(wl_name, name, f"{med['time']:.1f}", f"{medians[name]:.1f}", str(med["computed"]), hit)
        same = all(r["outputs"] == runs["naive"][0]["outputs"] for rs in runs.values() for r in rs)
        summary.append(f"{wl_name}: prefix / naive throughput = {medians['prefix'] / medians['naive']:.3f}x, "
                       f"identical outputs: {same}")
    console.print(table)
    for line in summary:
        console.print(line)


if __name__ == "__main__":
    main()
