"""Paged attention latency: v1 / v2 (NVRTC-compiled kernels_cu/) and the torch reference.

    python experiments/kernel_bench.py [--batch 1 4 16 64 256] [--context 512 1024 4096 16384]
        [--dtype float16 bfloat16] [--kv-cache-dtype auto fp8_e4m3] [--iters 100] [--repeats 11]

Setup after vLLM's benchmark_paged_attention.py: 64 query / 8 KV heads, head 128, block 16, fp16 and
bf16, random block tables, every sequence of the same length; `--kv-cache-dtype fp8_e4m3` adds rows
with a one-byte cache (per-head scales), which reads half the bytes. Besides µs it prints achieved
bandwidth (unique K+V bytes read / time, at the cache's element size) as % of a measured
device-to-device copy, so a reader knows how far
from the memory limit each kernel is, the ratio v1 µs / v2 µs, and the faster of v1 and v2 with its %.

How it times, and why:
- CUDA graphs. A small decode call runs for a few µs, less than the Python and launch overhead of
  issuing it, so timing back-to-back eager calls measures the host. Each kernel is captured `--iters`
  times into one CUDA graph (after one eager warm-up call per input set on a side stream, as capture
  requires) and the graph is replayed between CUDA events; µs per call = elapsed / calls in the graph.
- L2 rotation. K/V that stay in L2 (50 MB on an H100) from one call to the next are read faster than
  DRAM allows, and "% of copy bandwidth" could pass 100. Each row allocates several independent sets
  of query, K/V caches and block tables, together over 3x the L2 size, and consecutive calls in the
  graph cycle through them, so no call finds in L2 what the previous ones read. Rotating inside the
  graph keeps flush kernels out of the timed region.
- Median and spread. Each graph is replayed `--repeats` times; a cell shows the median µs and, after
  ±, half the interquartile range as % of the median. The bandwidth % uses the median.
- The copy baseline copies a 1 GiB buffer (far past L2) in a graph the same way.
- The torch reference allocates per call and is there as a scale, not a contender, so it is timed
  eagerly (events around a loop over the same rotating sets, median of repeats): its µs include host
  overhead. It is skipped (`-`) where its fp32 copies of K/V would not fit.
A kernel that refuses a shape (v1 past the device's shared memory) prints `-`.

Without a GPU it measures NVRTC cold (fresh cache) and warm (cache hit) compile times instead and
takes no kernel timing.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from unittest import mock

import torch

from paged import kernels
from paged.kernels.features import KV_CACHE_DTYPES, cache_dtype
from paged.kernels.testing import random_cache
from paged.kernels.toolchain import nvrtc, specs
from paged.kernels.toolchain.cache_dir import ENV_VAR

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 64, 8, 128, 16
TORCH_MAX_BYTES = 2 << 30  # the reference gathers K/V into fp32 copies; beyond this it would not fit
# Rotating inputs span this many L2 sizes: a margin, since L2 replacement is not strict LRU.
L2_MULTIPLE = 3
# Sets below 3 * 50 MiB / 512 = 300 KiB take ~0.1 µs of DRAM time, far under a call's latency, so
# whether they hit L2 no longer matters; more sets would only lengthen warm-up and capture.
MAX_SETS = 512
# Share of free memory the rotating sets may take; the rest is for scratch, graph pools and the reference.
MEMORY_FRACTION = 0.5
COPY_BYTES = 1 << 30
COPY_CALLS = 10  # 1 GiB copies per graph: each takes ~1 ms, well above event resolution
DTYPE_LABELS = {torch.float16: "fp16", torch.bfloat16: "bf16"}
KV_LABELS = {"auto": "=", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}


def compile_times(arch: str, full: bool) -> None:
    units = specs.dispatchable_units() if full else specs.default_units()
    what = "every dispatchable instantiation" if full else "default configurations (fp16/bf16, h128, b16)"
    nvrtc.toolchain()
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, {ENV_VAR: cache}):
        start = time.perf_counter()
        cold = nvrtc.compile_units(units, arch)
        cold_s = time.perf_counter() - start
        start = time.perf_counter()
        warm = nvrtc.compile_units(units, arch)
        warm_s = time.perf_counter() - start
    assert not any(c.cached for c in cold) and all(c.cached for c in warm)
    kernels_n = sum(len(u.kernels) for u in units)
    slowest = max(cold, key=lambda c: c.compile_s)
    spills = sum(1 for c in cold for i in c.infos if i.spill_stores or i.spill_loads)
    print(f"NVRTC {'.'.join(map(str, nvrtc.toolchain().version))}, {arch}, {what}: {len(units)} units / "
          f"{kernels_n} kernels")
    print(f"  cold (fresh cache): {cold_s:8.2f} s   slowest unit {slowest.unit.label} {slowest.compile_s:.2f} s")
    print(f"  warm (cache hit):   {warm_s:8.3f} s")
    print(f"  kernels with register spills: {spills}")


@dataclass(frozen=True)
class Timing:
    """µs per call: the median of repeated measurements, and half their interquartile range as % of it."""

    us: float
    spread: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        median = statistics.median(samples)
        q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        return cls(median, 50 * (q3 - q1) / median)


def _event_samples(run: Callable[[], object], calls_per_run: int, repeats: int) -> list[float]:
    """µs per call of `run` (which makes `calls_per_run` calls), once per repeat."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / calls_per_run)
    return samples


def _graph_samples(calls: Sequence[Callable[[], object]], length: int, repeats: int) -> list[float]:
    """µs per call over `repeats` replays of one CUDA graph of `length` calls cycling through `calls`.

    Each call runs once eagerly on a side stream before capture, as torch requires: that compiles,
    loads and configures the kernels, and lets the op memoise its checks for these very tensors, so
    nothing in the captured region synchronises with the host. It also raises a kernel's ValueError
    before any capture begins.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on its own non-default stream
        for i in range(length):
            calls[i % len(calls)]()
    graph.replay()  # the first replay uploads the graph; keep it out of the samples
    return _event_samples(graph.replay, length, repeats)


def _eager_samples(calls: Sequence[Callable[[], object]], length: int, repeats: int) -> list[float]:
    """As `_graph_samples`, with the calls issued from Python each time: host overhead included."""
    for call in calls:
        call()

    def loop() -> None:
        for i in range(length):
            calls[i % len(calls)]()

    return _event_samples(loop, length, repeats)


def copy_bandwidth(repeats: int) -> tuple[float, Timing]:
    """Device-to-device copy of a buffer far larger than L2: bytes read + written per second at the
    median, and the timing of one copy."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    timing = Timing.of(_graph_samples([lambda: dst.copy_(src)], COPY_CALLS, repeats))
    return 2 * COPY_BYTES / (timing.us * 1e-6), timing


@dataclass(frozen=True)
class _Inputs:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor


def _cache(num_blocks: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V caches in `kv_dtype` (an fp8 one from the `dtype` values, read with scales of 1)."""
    key_cache, value_cache = random_cache(num_blocks, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype, device="cuda")
    if kv_dtype == dtype:
        return key_cache, value_cache
    x = 16 // kv_dtype.itemsize
    key_cache = key_cache.transpose(2, 3).reshape(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_SIZE // x, x)
    return key_cache.transpose(2, 3).contiguous().to(kv_dtype), value_cache.to(kv_dtype)


def _input_sets(batch: int, context: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> list[_Inputs]:
    """Independent input sets, together over `L2_MULTIPLE` L2 sizes (at least two, at most `MAX_SETS`)
    where memory allows."""
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    element = torch.empty((), dtype=dtype).element_size()
    set_bytes = (kv_dtype.itemsize * 2 * num_blocks * NUM_KV_HEADS * HEAD_SIZE * BLOCK_SIZE
                 + element * batch * NUM_HEADS * HEAD_SIZE + 4 * num_blocks)
    wanted = min(MAX_SETS, max(2, -(-L2_MULTIPLE * torch.cuda.get_device_properties().L2_cache_size // set_bytes)))
    torch.cuda.empty_cache()  # so that free memory counts what earlier rows released
    fits = int(torch.cuda.mem_get_info()[0] * MEMORY_FRACTION) // set_bytes
    # Only sets many times larger than L2 are cut short, and L2 holds a negligible share of such a set.
    count = max(1, min(wanted, fits))
    scale = HEAD_SIZE**-0.5
    sets = []
    for _ in range(count):
        key_cache, value_cache = _cache(num_blocks, dtype, kv_dtype)
        tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
        query = torch.empty(batch, NUM_HEADS, HEAD_SIZE, dtype=dtype, device="cuda").uniform_(-scale, scale)
        sets.append(_Inputs(query, key_cache, value_cache, tables))
    return sets


def _kernel_cell(timing: Timing | None, kv_bytes: int, peak: float) -> str:
    if timing is None:
        return f"{'-':>10} {'':>5} {'-':>6}"
    spread = f"±{timing.spread:.0f}%"
    return f"{timing.us:>10.1f} {spread:>5} {100 * kv_bytes / (timing.us * 1e-6) / peak:>5.0f}%"


def _row(batch: int, context: int, dtype: torch.dtype, kv: str, peak: float, iters: int, repeats: int) -> str:
    kv_dtype = cache_dtype(kv, dtype)
    sets = _input_sets(batch, context, dtype, kv_dtype)
    length = -(-iters // len(sets)) * len(sets)  # every set equally often
    # One tensor for every set, since all sequences have the same length. The warm-up calls use the
    # very tensors the graph captures, so a check the op memoises per tensor (max_seq_len against
    # seq_lens, which syncs with the host) is done before capture, where a sync would be illegal.
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    scale = HEAD_SIZE**-0.5
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_SIZE * sets[0].key_cache.element_size()

    scales = {}
    if kv_dtype != dtype:
        ones = torch.ones(NUM_KV_HEADS, device="cuda")
        scales = {"k_scale": ones, "v_scale": ones}

    def calls(backend: str, version: str) -> list[Callable[[], object]]:
        return [
            functools.partial(kernels.paged_attention, s.query, s.key_cache, s.value_cache, s.block_tables,
                              seq_lens, scale, version=version, backend=backend, max_seq_len=context, **scales)
            for s in sets
        ]

    native: dict[str, Timing | None] = {}
    for version in ("v1", "v2"):
        try:
            native[version] = Timing.of(_graph_samples(calls("cuda", version), length, repeats))
        except ValueError:  # v1 past the device's shared memory
            native[version] = None
    reference = None
    if 2 * kv_bytes <= TORCH_MAX_BYTES:
        reference = Timing.of(_eager_samples(calls("torch", "v1"), length, repeats))
    v1, v2 = native["v1"], native["v2"]
    ratio = f"{v1.us / v2.us:.2f}" if v1 is not None and v2 is not None else "-"
    measured = {name: t for name, t in native.items() if t is not None}
    best = "-"
    if measured:
        name = min(measured, key=lambda n: measured[n].us)
        best = f"{name} {100 * kv_bytes / (measured[name].us * 1e-6) / peak:.0f}%"
    return " ".join([
        f"{batch:>6} {context:>8} {DTYPE_LABELS[dtype]:>5} {KV_LABELS[kv]:>5}",
        _kernel_cell(v1, kv_bytes, peak), _kernel_cell(v2, kv_bytes, peak), f"{ratio:>6}",
        _kernel_cell(reference, kv_bytes, peak), f"{kernels.choose_version(context, batch, NUM_HEADS):>5}",
        f"{best:>8}",
    ])


def _kernel_header(name: str) -> str:
    return f"{name + ' µs':>10} {'±':>5} {name + ' %':>6}"


def gpu_table(batches: list[int], contexts: list[int], dtypes: list[torch.dtype], kvs: list[str], iters: int,
              repeats: int) -> None:
    peak, copy = copy_bandwidth(repeats)
    props = torch.cuda.get_device_properties()
    print(f"{props.name}: L2 {props.L2_cache_size / 2**20:.0f} MiB, device-to-device copy {peak / 1e9:.0f} GB/s "
          f"(±{copy.spread:.0f}%)")
    print(f"v1, v2: median of {repeats} CUDA-graph replays of >= {iters} calls rotating over inputs > {L2_MULTIPLE}x "
          f"L2; ±: half the interquartile range; %: of copy bandwidth at the median. torch: eager, host included")
    print("kv: the cache's dtype ('=': the query's; e4m3 / e5m2: fp8, whose % counts its one-byte reads)")
    print(f"{'batch':>6} {'context':>8} {'dtype':>5} {'kv':>5} {_kernel_header('v1')} {_kernel_header('v2')} "
          f"{'v1/v2':>6} {_kernel_header('torch')} {'auto':>5} {'best':>8}")
    for batch in batches:
        for context in contexts:
            for dtype in dtypes:
                for kv in kvs:
                    print(_row(batch, context, dtype, kv, peak, iters, repeats), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    parser.add_argument("--dtype", nargs="+", choices=["float16", "bfloat16"], default=["float16", "bfloat16"])
    parser.add_argument("--kv-cache-dtype", nargs="+", choices=["auto", *KV_CACHE_DTYPES], default=["auto"],
                        help="cache dtypes per row (auto: the query's)")
    parser.add_argument("--iters", type=int, default=100, help="calls per CUDA graph (rounded up to whole rotations)")
    parser.add_argument("--repeats", type=int, default=11, help="graph replays per cell; the median is reported")
    parser.add_argument("--arch", default="sm_90", help="compile target when no GPU is present")
    parser.add_argument("--full", action="store_true", help="time every instantiation, not only the defaults")
    args = parser.parse_args()
    if args.iters < 1 or args.repeats < 3:
        parser.error("--iters must be at least 1 and --repeats at least 3 (for an interquartile range)")
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        compile_times(f"sm_{major}{minor}", args.full)
        gpu_table(args.batch, args.context, [getattr(torch, d) for d in args.dtype], args.kv_cache_dtype, args.iters,
                  args.repeats)
    else:
        compile_times(args.arch, args.full)
        print("no CUDA device: no kernel timing was taken (compile times only)")


if __name__ == "__main__":
    main()
