"""Decode attention on the native cpu backend: the v1, v2 and v3 ops side by side.

    python experiments/cpu/cpu_decode_bench.py [--repeats 21] [--dtypes float32 bfloat16] [--torch]
    python experiments/cpu/cpu_decode_bench.py --quick

SmolLM2-135M's attention shape (9 query heads over 3 KV heads, head 64, block 16), one layer's
decode call, over a batch of 32 x 400 contexts (the serving benchmark's kind: prompts of 32-512
tokens plus outputs), 32 x 1K (the issue's bar: v3 not slower than v2 there), 8 x 4K and 1 x 16K.
Each op is called as the executor calls it once a step is planned
(`paged.kernels.planned.DecodeAttention`): the backend's op on checked arguments, v2 at vLLM's
partition size 512, v3 with the split plan `decode_workspace` made for the step (its split count
is printed). Block tables are random permutations, so tiles are scattered as in a long-running
cache. Paths alternate within each repeat so machine noise hits all alike; medians are reported,
in ms per call, with `v3/v2` the ratio of v3's time to v2's (below 1: v3 is faster). Outputs are
checked against v1 first. `--torch` adds the torch reference. `--quick`: fp32 only, 5 repeats.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from paged import kernels
from paged.kernels.backends.interface import CacheView
from paged.kernels.split_plan import SplitPlan
from paged.kernels.testing import random_cache

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 9, 3, 64, 16
SCALE = HEAD_SIZE**-0.5
PARTITION_SIZE = 512
# name -> (sequences, context length)
WORKLOADS = {"32 x 400": (32, 400), "32 x 1K": (32, 1024), "8 x 4K": (8, 4096), "1 x 16K": (1, 16384)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_batch(num_seqs: int, seq_len: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, CacheView]:
    """A decode batch of `num_seqs` contexts of `seq_len` tokens, each in its own blocks, scattered."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-seq_len // BLOCK_SIZE)
    key_cache, value_cache = random_cache(num_seqs * per_seq, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype,
                                          generator=gen)
    tables = torch.randperm(num_seqs * per_seq, generator=gen).to(torch.int32).view(num_seqs, per_seq)
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
    query = torch.randn(num_seqs, NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    return query, CacheView(key_cache, value_cache, tables, seq_lens)


def paths(query: torch.Tensor, cache: CacheView, with_torch: bool) -> tuple[dict[str, Callable[[], torch.Tensor]],
                                                                            SplitPlan]:
    """The ops to time, each planned once as `DecodeAttention` plans a step; and v3's plan."""
    cpu = kernels.get_backend("cpu")
    num_seqs, max_seq_len = query.shape[0], int(cache.seq_lens.max())

    def op(backend: str, version: str) -> Callable[[], torch.Tensor]:
        impl = kernels.get_backend(backend)
        workspace = impl.decode_workspace(num_seqs, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, version,
                                          PARTITION_SIZE, max_seq_len, None, query.device)
        return lambda: impl.paged_attention(query, cache, SCALE, version, PARTITION_SIZE, max_seq_len, None,
                                            workspace=workspace)

    plan = cpu.decode_workspace(num_seqs, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, "v3", PARTITION_SIZE,
                                max_seq_len, None, query.device)
    assert isinstance(plan, SplitPlan)
    ops = {version: op("cpu", version) for version in ("v1", "v2", "v3")}
    if with_torch:
        ops["torch"] = op("torch", "v1")
    return ops, plan


def medians(ops: dict[str, Callable[[], torch.Tensor]], repeats: int) -> dict[str, float]:
    """ms per call of each op, the order rotating every repeat, after one warm-up call each."""
    reference = ops["v1"]()
    for name, fn in ops.items():
        torch.testing.assert_close(fn().float(), reference.float(), atol=2e-3, rtol=2e-2,
                                   msg=lambda m, n=name: f"{n} disagrees with v1: {m}")
    samples: dict[str, list[float]] = {name: [] for name in ops}
    names = list(ops)
    for i in range(repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            ops[name]()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=21, help="timed calls per op and workload (median)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["float32", "bfloat16"])
    parser.add_argument("--torch", action="store_true", help="also time the torch reference")
    parser.add_argument("--quick", action="store_true", help="fp32 only, 5 repeats")
    args = parser.parse_args()
    repeats, dtypes = (5, ["float32"]) if args.quick else (args.repeats, args.dtypes)

    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.1f}; median of {repeats}, ms per layer call; q{NUM_HEADS}/kv{NUM_KV_HEADS} "
          f"head {HEAD_SIZE} block {BLOCK_SIZE}")
    extra = f" {'torch':>8}" if args.torch else ""
    print(f"{'workload':<9} {'dtype':<9} {'v1':>8} {'v2':>8} {'v3':>8}{extra} {'splits':>7} {'v3/v2':>6} {'v3/v1':>6}")
    for dtype_name in dtypes:
        for name, (num_seqs, seq_len) in WORKLOADS.items():
            query, cache = make_batch(num_seqs, seq_len, DTYPES[dtype_name])
            ops, plan = paths(query, cache, args.torch)
            t = medians(ops, repeats)
            torch_col = f" {t['torch']:>8.2f}" if args.torch else ""
            print(f"{name:<9} {dtype_name:<9} {t['v1']:>8.2f} {t['v2']:>8.2f} {t['v3']:>8.2f}{torch_col} "
                  f"{plan.num_splits:>7} {t['v3'] / t['v2']:>6.2f} {t['v3'] / t['v1']:>6.2f}")


if __name__ == "__main__":
    main()
