"""Chunked prefill vs whole-prompt prefill, and prefix de-duplication, on SmolLM2-135M on this CPU.

    python experiments/studies/chunked_prefill.py [--repeats 3] [--requests 24] [--budget 512] [override ...]

(a) A mixed workload (1 request/s, prompts 300 tokens on average and up to 1536, outputs 128 on
average) under vLLM V0's scheduling (whole prompts, prefill-only steps) and with chunked prefill
(decode-first) at the default budget (4096) and at `--budget` tokens a step: mean / p99 TPOT, mean
TTFT and output throughput, the median of `--repeats` runs rotating which goes first. Greedy
outputs are compared too.
(b) 32 requests sharing a 400-token system prompt, each with its own 20-token question, submitted
together (at most 31 x 400 / (32 x 420) = 0.92 of the prompt tokens can hit): the prefix hit rate
with and without `scheduler.prefix_dedup`, under fcfs and lpm, and output throughput against the
naive allocator (no prefix caching), medians as in (a).
"""

from __future__ import annotations

import argparse
import logging
import statistics
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from paged.experiment.run import run_quietly

BASE = ["model=smollm2-135m", "allocator.num_blocks=1024"]


def run(overrides: list[str]) -> tuple[dict[str, Any], list[list[int]]]:
    summary, engine = run_quietly([*BASE, *overrides])
    return summary, [r.outputs()[0].token_ids for r in engine.metrics.requests]


def medians(configs: dict[str, list[str]], repeats: int, keys: list[str]) -> tuple[dict[str, dict], dict]:
    """Per config, the median of each key over `repeats` runs, the order rotating every repeat."""
    samples: dict[str, dict[str, list[float]]] = {name: {k: [] for k in keys} for name in configs}
    outputs: dict[str, list[list[int]]] = {}
    names = list(configs)
    for i in range(repeats):
        for name in names[i % len(names):] + names[: i % len(names)]:
            summary, outputs[name] = run(configs[name])
            for k in keys:
                samples[name][k].append(summary[k] if summary[k] is not None else float("nan"))
    return {n: {k: statistics.median(v) for k, v in ks.items()} for n, ks in samples.items()}, outputs


def mixed(repeats: int, requests: int, budget: int, extra: list[str]) -> Table:
    load = ["workload=synthetic", f"workload.num_requests={requests}", "workload.arrival_rate=1",
            "workload.prompt_len_mean=300", "workload.prompt_len_max=1536", "workload.length_scale=1.0",
            "workload.output_len_mean=128", "workload.output_len_max=256", *extra]
    configs = {
        "vLLM V0: whole prompts, prefill-only steps": [
            *load, "scheduler.chunked_prefill=false", "scheduler.batch_order=prefill-first"],
        "chunked, decode-first (the default)": load,
        f"chunked, decode-first, budget {budget}": [*load, f"scheduler.max_num_batched_tokens={budget}"],
    }
    keys = ["tpot_mean_s", "tpot_p99_s", "ttft_mean_s", "output_tokens_per_s", "num_engine_steps"]
    results, outputs = medians(configs, repeats, keys)
    same = len({str(o) for o in outputs.values()}) == 1
    table = Table(title=f"(a) {requests} mixed requests at 1 req/s, median of {repeats} runs "
                        f"(greedy outputs identical: {same})")
    for col in ["scheduling", "TPOT mean (ms)", "TPOT p99 (ms)", "TTFT mean (s)", "output tok/s", "steps"]:
        table.add_column(col, justify="right")
    for name, r in results.items():
        table.add_row(name, f"{r['tpot_mean_s'] * 1e3:.1f}", f"{r['tpot_p99_s'] * 1e3:.1f}", f"{r['ttft_mean_s']:.2f}",
                      f"{r['output_tokens_per_s']:.1f}", f"{r['num_engine_steps']:.0f}")
    return table


def dedup(repeats: int, extra: list[str]) -> Table:
    load = ["workload=fixed", "workload.num_requests=32", "workload.prompt_len=420", "workload.shared_prefix_len=400",
            "workload.output_len=16", *extra]
    configs = {
        "naive allocator": [*load, "allocator=naive"],
        "prefix, fcfs, no de-dup": [*load, "scheduler.prefix_dedup=false"],
        "prefix, fcfs": load,
        "prefix, lpm": [*load, "scheduler=lpm"],
    }
    results, _ = medians(configs, repeats, ["prefix_cache_hit_rate", "output_tokens_per_s", "ttft_mean_s"])
    naive = results["naive allocator"]["output_tokens_per_s"]
    table = Table(title=f"(b) 32 requests sharing a 400-token prefix, submitted together, median of {repeats}")
    for col in ["configuration", "prefix hit rate", "output tok/s", "vs naive", "TTFT mean (s)"]:
        table.add_column(col, justify="right")
    for name, r in results.items():
        hit = r["prefix_cache_hit_rate"]
        table.add_row(name, "n/a" if np.isnan(hit) else f"{hit:.3f}", f"{r['output_tokens_per_s']:.1f}",
                      f"{r['output_tokens_per_s'] / naive:.2f}x", f"{r['ttft_mean_s']:.2f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens of the small-budget run")
    parser.add_argument("--skip-mixed", action="store_true", help="only table (b)")
    parser.add_argument("--skip-dedup", action="store_true", help="only table (a)")
    args, extra = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=140)
    if not args.skip_mixed:
        console.print(mixed(args.repeats, args.requests, args.budget, extra))
    if not args.skip_dedup:
        console.print(dedup(args.repeats, extra))


if __name__ == "__main__":
    main()
