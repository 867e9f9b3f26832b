"""Prefill attention on the CPU: the executor's former per-sequence path against the batched ops.

    python experiments/prefill_bench.py [--repeats 7] [--memory torch]

SmolLM2-135M's attention shape (9 query / 3 KV heads, head 64, block 16, fp32), one layer's call.
Paths, alternated within each repeat so machine noise hits all alike (medians reported):
- `per-seq`: what the executor ran before `prefill_attention` existed: per sequence, gather its
  K/V out of the paged cache, then causal `scaled_dot_product_attention`;
- `torch`: `prefill_attention(backend="torch")`, one padded SDPA call for the batch;
- `cpu`: `prefill_attention(backend="cpu")`, the native kernel reading the cache in place.
Outputs are checked against each other. `--memory BACKEND` instead reports the peak resident
memory one call of the largest workload adds (run it in a fresh process).
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
from collections.abc import Callable

import torch

from paged import kernels
from paged.kernels.testing import gather_kv, random_cache

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_SIZE**-0.5
# name -> (q_len, seq_len) per sequence
WORKLOADS: dict[str, Callable[[random.Random], list[tuple[int, int]]]] = {
    "16 seqs, prompts 32-512": lambda r: [(n, n) for n in (r.randint(32, 512) for _ in range(16))],
    "64 seqs, prompts 32-512": lambda r: [(n, n) for n in (r.randint(32, 512) for _ in range(64))],
    "16 seqs x 512": lambda r: [(512, 512)] * 16,
    "64 seqs, 512 cached + 32 new": lambda r: [(32, 544)] * 64,
}


def make_batch(lens: list[tuple[int, int]]) -> dict[str, object]:
    blocks = [-(-n // BLOCK_SIZE) for _, n in lens]
    key_cache, value_cache = random_cache(sum(blocks), NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    order = torch.randperm(sum(blocks)).to(torch.int32)
    start = 0
    for row, count in zip(tables, blocks):
        row[:count] = order[start : start + count]
        start += count
    q_lens = [q for q, _ in lens]
    return dict(
        query=torch.randn(sum(q_lens), NUM_HEADS, HEAD_SIZE),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables,
        query_start_loc=torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor([n for _, n in lens], dtype=torch.int32),
        max_query_len=max(q_lens),
        max_seq_len=max(n for _, n in lens),
    )


def per_sequence(b: dict) -> torch.Tensor:
    """The executor's former prefill: a gather and an SDPA call per sequence."""
    query = b["query"]
    out = torch.empty_like(query)
    starts = b["query_start_loc"].tolist()
    for i, context_len in enumerate(b["seq_lens"].tolist()):
        start, end = starts[i], starts[i + 1]
        keys, values = gather_kv(b["key_cache"], b["value_cache"], b["block_tables"][i], context_len)
        q = query[start:end].transpose(0, 1)
        k = keys.transpose(0, 1).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=0)
        v = values.transpose(0, 1).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=0)
        num_new = end - start
        if num_new == context_len:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE)
        else:
            q_pos = torch.arange(context_len - num_new, context_len)
            mask = q_pos[:, None] >= torch.arange(context_len)[None, :]
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE)
        out[start:end] = o.transpose(0, 1)
    return out


def batched(backend: str) -> Callable[[dict], torch.Tensor]:
    def run(b: dict) -> torch.Tensor:
        return kernels.prefill_attention(
            b["query"], b["key_cache"], b["value_cache"], b["block_tables"], b["query_start_loc"], b["seq_lens"],
            SCALE, backend=backend, max_query_len=b["max_query_len"], max_seq_len=b["max_seq_len"],
        )

    return run


PATHS = {"per-seq": per_sequence, "torch": batched("torch"), "cpu": batched("cpu")}


def timings(batch: dict, repeats: int) -> dict[str, float]:
    outs = {name: fn(batch) for name, fn in PATHS.items()}  # warm-up, and the outputs to compare
    for name, out in outs.items():
        torch.testing.assert_close(out, outs["per-seq"], atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    samples: dict[str, list[float]] = {name: [] for name in PATHS}
    names = list(PATHS)
    for i in range(repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            PATHS[name](batch)
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def peak_memory(backend: str) -> None:
    batch = make_batch(WORKLOADS["16 seqs x 512"](random.Random(0)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    PATHS[backend](batch)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    scores = 16 * NUM_HEADS * 512 * 512 * 4 / 2**20
    print(f"{backend}: peak RSS grew {grown:.0f} MiB for 16 x 512 (padded fp32 scores would be {scores:.0f} MiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--memory", choices=list(PATHS), help="report one call's peak memory instead")
    args = parser.parse_args()
    if args.memory:
        peak_memory(args.memory)
        return
    print(f"{torch.get_num_threads()} threads; median of {args.repeats}, ms per layer call")
    print(f"{'workload':<30} {'per-seq':>9} {'torch':>9} {'cpu':>9} {'per-seq/cpu':>12}")
    for name, make in WORKLOADS.items():
        t = timings(make_batch(make(random.Random(0))), args.repeats)
        print(f"{name:<30} {t['per-seq'] * 1e3:>9.1f} {t['torch'] * 1e3:>9.1f} {t['cpu'] * 1e3:>9.1f} "
              f"{t['per-seq'] / t['cpu']:>11.2f}x")


if __name__ == "__main__":
    main()
