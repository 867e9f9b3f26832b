"""Two builds of the native cpu kernels in one process, call by call alternating: decode v3 or
prefill attention at SmolLM2's shape (9 query / 3 KV heads, head 64, block 16), tiles scattered.

    python experiments/results/bench-vs-vllm/issue47-pairs/kernel_ab.py decode bfloat16 32 1024 \
        --layers 20 --old /tmp/old-kernels_cu --new kernels_cu
    python .../kernel_ab.py prefill bfloat16 8 400 --old ... --new ...

`--old`/`--new`: copies of `kernels_cu/` (each built as `PAGED_KERNELS_DIR` would build it). Decode
runs `--layers` batches of distinct caches per timed call, as a step's layers read distinct caches
from memory (one batch fits in this CPU's L3). Prints ms per call (medians), B/A and GB/s of K/V
read (decode) or GFLOP/s (prefill), and the largest difference between the two builds' outputs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from paged import kernels
from paged.kernels.backends import cpu as cpu_backend
from paged.kernels.backends.interface import CacheView
from paged.kernels.testing import random_cache

sys.path.insert(0, str(Path("experiments/cpu").resolve()))
import cpu_decode_bench as bench  # noqa: E402  (sibling script, not a package)


def load(directory: str) -> object:
    os.environ["PAGED_KERNELS_DIR"] = str(Path(directory).resolve())
    cpu_backend._library = None
    return cpu_backend.load()


def decode_call(dtype: torch.dtype, num_seqs: int, seq_len: int, layers: int) -> tuple[Callable[[], object], float]:
    cpu = kernels.get_backend("cpu")
    batches = [bench.make_batch(num_seqs, seq_len, dtype, seed=i) for i in range(layers)]
    workspace = cpu.decode_workspace(num_seqs, bench.NUM_HEADS, bench.NUM_KV_HEADS, bench.HEAD_SIZE, bench.BLOCK_SIZE,
                                     "v3", bench.PARTITION_SIZE,
                                     seq_len, None, batches[0][0].device)

    def call() -> object:
        return [cpu.paged_attention(q, c, bench.SCALE, "v3", bench.PARTITION_SIZE, seq_len, None, workspace=workspace)
                for q, c in batches]

    return call, num_seqs * seq_len * bench.NUM_KV_HEADS * bench.HEAD_SIZE * 2 * dtype.itemsize * layers


def prefill_call(dtype: torch.dtype, num_seqs: int, seq_len: int) -> tuple[Callable[[], object], float]:
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-seq_len // bench.BLOCK_SIZE)
    key_cache, value_cache = random_cache(num_seqs * per_seq, bench.NUM_KV_HEADS, bench.HEAD_SIZE, bench.BLOCK_SIZE,
                                          dtype, generator=gen)
    tables = torch.randperm(num_seqs * per_seq, generator=gen).to(torch.int32).view(num_seqs, per_seq)
    cache = CacheView(key_cache, value_cache, tables, torch.full((num_seqs,), seq_len, dtype=torch.int32))
    query = torch.randn(num_seqs * seq_len, bench.NUM_HEADS, bench.HEAD_SIZE, generator=gen).to(dtype)
    starts = torch.arange(0, num_seqs * seq_len + 1, seq_len, dtype=torch.int32)
    cpu = kernels.get_backend("cpu")
    return (lambda: [cpu.prefill_attention(query, cache, starts, bench.SCALE, seq_len, seq_len, None)],
            num_seqs * seq_len * seq_len / 2 * bench.NUM_HEADS * bench.HEAD_SIZE * 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("op", choices=["decode", "prefill"])
    parser.add_argument("dtype", choices=["bfloat16", "float32"])
    parser.add_argument("num_seqs", type=int)
    parser.add_argument("seq_len", type=int)
    parser.add_argument("--layers", type=int, default=20, help="decode: distinct caches per timed call")
    parser.add_argument("--old", required=True)
    parser.add_argument("--new", required=True)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    for flag, directory in (("--old", args.old), ("--new", args.new)):
        if not (Path(directory) / "cpu").is_dir():
            parser.error(f"{flag} {directory} is not a copy of kernels_cu/ (no cpu/ in it)")
    dtype = getattr(torch, args.dtype)
    libraries = [load(args.old), load(args.new)]
    if args.op == "decode":
        call, amount = decode_call(dtype, args.num_seqs, args.seq_len, args.layers)
    else:
        call, amount = prefill_call(dtype, args.num_seqs, args.seq_len)
    outputs = []
    for library in libraries:
        cpu_backend._library = library
        outputs.append(torch.cat([o.float().flatten() for o in call()]))
    times: list[list[float]] = [[], []]
    for r in range(args.repeats):
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            cpu_backend._library = libraries[i]
            start = time.perf_counter()
            call()
            times[i].append((time.perf_counter() - start) * 1e3)
    old, new = (statistics.median(t) for t in times)
    unit = "GB/s" if args.op == "decode" else "GFLOP/s"
    per_call = args.layers if args.op == "decode" else 1
    print(f"{args.op} {args.dtype} {args.num_seqs} x {args.seq_len}, {torch.get_num_threads()} threads: "
          f"old {old / per_call:.3f} new {new / per_call:.3f} ms per call, new/old {new / old:.3f}, "
          f"{amount / old / 1e6:.1f} -> {amount / new / 1e6:.1f} {unit}; "
          f"largest difference {(outputs[0] - outputs[1]).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
