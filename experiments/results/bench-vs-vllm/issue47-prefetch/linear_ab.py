"""Two builds of the packed linear loop (kernels_cu/cpu/gemm_packed.h) in one process, alternating:
SmolLM2-135M's 120 layer calls of a decode step (30 layers of distinct weights, so they come from
memory), at given row counts or over a drain (rows 32 down to 1, as the benchmark's batch finishes).

    python experiments/results/bench-vs-vllm/issue47-prefetch/linear_ab.py bfloat16|float32 \
        --old /tmp/old-kernels_cu --new kernels_cu [--rows 1 8 16 32] [--passes 12]

`--old`/`--new`: copies of `kernels_cu/` (each built as `PAGED_KERNELS_DIR` would build it). Where the
packed weights lie in memory moved their time here: the same build packed four times, the first
copy ran ~5% slower than the other three, which agreed within 1-2% (a first A/B of one copy each had
B 1-9% ahead of A with the same build on both sides). So a first copy is packed and never timed,
then each build packs two, in the order A, B, B, A, and the passes run all four, rotating which goes
first; A's time is the median over its two copies, B's over its. Prints ms per step, B/A, GFLOP/s and
the weights' GB/s, and checks the two builds' outputs are equal to the bit.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
# isort: off
import paged  # noqa: E402,F401  (first: its short OpenMP spin must be set before torch loads libgomp)
import torch  # noqa: E402
# isort: on

from paged.kernels import packed_linear  # noqa: E402
from paged.kernels.backends import cpu as cpu_backend  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate_up, down: (out, in)
LAYERS = 30
PARAMS = sum(o * i for o, i in SHAPES) * LAYERS


def build(directory: str, weights: list[list[torch.Tensor]]) -> list[list[packed_linear.PackedLinear]]:
    os.environ["PAGED_KERNELS_DIR"] = str(Path(directory).resolve())
    cpu_backend._library = None
    cpu_backend.load()
    return [[packed_linear.PackedLinear(w) for w in layer] for layer in weights]


def step(layers: list[list[packed_linear.PackedLinear]], x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    out = x
    for qkv, o, gate_up, down in layers:
        qkv.run(x)
        o.run(x)
        out = gate_up.run(x)
        down.run(h)
    return out


def alternate(calls: list[Callable[[], object]], passes: int) -> tuple[float, float]:
    """Median seconds of A's calls (the first and last of the four) and of B's (the middle two), each
    pass running all four starting one further along."""
    times: list[list[float]] = [[] for _ in calls]
    for i in range(passes):
        for k in range(len(calls)):
            which = (i + k) % len(calls)
            start = time.perf_counter()
            calls[which]()
            times[which].append(time.perf_counter() - start)
    return statistics.median(times[0] + times[3]), statistics.median(times[1] + times[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dtype", choices=["bfloat16", "float32"])
    parser.add_argument("--old", required=True)
    parser.add_argument("--new", required=True)
    parser.add_argument("--rows", type=int, nargs="*", default=[], help="row counts (default: the drain only)")
    parser.add_argument("--passes", type=int, default=12)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    weights = [[torch.randn(o, i, dtype=dtype) * 0.02 for o, i in SHAPES] for _ in range(LAYERS)]
    spare = build(args.old, weights)  # the slower first copy (above), kept alive so no build reuses its memory
    builds = [build(directory, weights) for directory in (args.old, args.new, args.new, args.old)]
    inputs = {r: (torch.randn(r, 576, dtype=dtype), torch.randn(r, 1536, dtype=dtype)) for r in range(1, 33)}
    inputs |= {r: (torch.randn(r, 576, dtype=dtype), torch.randn(r, 1536, dtype=dtype)) for r in args.rows}
    print(f"{args.dtype}, {torch.get_num_threads()} threads, A = {args.old}, B = {args.new}")
    for rows in args.rows:
        x, h = inputs[rows]
        assert torch.equal(step(builds[0], x, h), step(builds[1], x, h)), "the builds' outputs differ"
        a, b = alternate([functools.partial(step, layers, x, h) for layers in builds], args.passes)
        print(f"rows {rows:3d}: A {a * 1e3:6.2f} ms ({2 * rows * PARAMS / a / 1e9:4.0f} GFLOP/s, "
              f"{PARAMS * dtype.itemsize / a / 1e9:4.1f} GB/s)  B {b * 1e3:6.2f} ms "
              f"({2 * rows * PARAMS / b / 1e9:4.0f} GFLOP/s, {PARAMS * dtype.itemsize / b / 1e9:4.1f} GB/s)  "
              f"B/A {b / a:.3f}")
    drain = [inputs[r] for r in range(32, 0, -1)]

    def run(layers: list[list[packed_linear.PackedLinear]]) -> None:
        for x, h in drain:
            step(layers, x, h)

    a, b = alternate([functools.partial(run, layers) for layers in builds], args.passes)
    del spare
    print(f"drain, rows 32..1: A {a * 1e3 / len(drain):.2f} ms/step  B {b * 1e3 / len(drain):.2f} ms/step  "
          f"B/A {b / a:.3f}")


if __name__ == "__main__":
    main()
