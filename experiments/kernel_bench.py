"""Paged attention latency: v1 / v2 (NVRTC-compiled kernels_cu/) and the torch reference.

    python experiments/kernel_bench.py [--batch 1 4 16 64 256] [--context 512 1024 4096 16384]

Setup after vLLM's benchmark_paged_attention.py: 64 query / 8 KV heads, head 128, block 16, fp16,
random block tables, every sequence of the same length. Besides µs it prints achieved bandwidth
(unique K+V bytes read / time) as % of a measured device-to-device copy, so a reader knows how far
from the memory limit each kernel is. Without a GPU it measures NVRTC cold (fresh cache) and warm
(cache hit) compile times instead and takes no kernel timing.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from unittest import mock

import torch

from paged import kernels
from paged.kernels.testing import random_cache
from paged.kernels.toolchain import nvrtc, specs
from paged.kernels.toolchain.cache_dir import ENV_VAR

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 64, 8, 128, 16
TORCH_MAX_BYTES = 2 << 30  # the reference gathers K/V into fp32 copies; beyond this it would not fit


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


def _time_us(fn, iters: int) -> float:  # noqa: ANN001 - any zero-argument callable
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = _time_us(lambda: dst.copy_(src), 20)
    return 2 * src.numel() / (us * 1e-6)


def _row(batch: int, context: int, peak: float, iters: int) -> str:
    scale = HEAD_SIZE**-0.5
    blocks_per_seq = -(-context // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    key_cache, value_cache = random_cache(num_blocks, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float16,
                                          device="cuda")
    tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.empty(batch, NUM_HEADS, HEAD_SIZE, dtype=torch.float16, device="cuda").uniform_(-scale, scale)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_SIZE * 2
    cells = [f"{batch:>6} {context:>8}"]
    for backend, version in (("cuda", "v1"), ("cuda", "v2"), ("torch", "v1")):
        if backend == "torch" and kv_bytes * 2 > TORCH_MAX_BYTES:
            cells.append(f"{'-':>10} {'-':>6}")
            continue

        def step(backend: str = backend, version: str = version) -> None:
            kernels.paged_attention(query, key_cache, value_cache, tables, seq_lens, scale, version=version,
                                    backend=backend, max_seq_len=context)

        try:
            us = _time_us(step, iters)
        except ValueError:  # v1 past the device's shared memory
            cells.append(f"{'-':>10} {'-':>6}")
            continue
        cells.append(f"{us:>10.1f} {100 * kv_bytes / (us * 1e-6) / peak:>5.0f}%")
    cells.append(f"{kernels.choose_version(context, batch, NUM_HEADS):>5}")
    return " ".join(cells)


def gpu_table(batches: list[int], contexts: list[int], iters: int) -> None:
    peak = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {peak / 1e9:.0f} GB/s")
    print(f"{'batch':>6} {'context':>8} {'v1 µs':>10} {'v1 %':>6} {'v2 µs':>10} {'v2 %':>6} {'torch µs':>10} "
          f"{'torch %':>8} {'auto':>5}")
    for batch in batches:
        for context in contexts:
            print(_row(batch, context, peak, iters))
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 1024, 4096, 16384])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--arch", default="sm_90", help="compile target when no GPU is present")
    parser.add_argument("--full", action="store_true", help="time every instantiation, not only the defaults")
    args = parser.parse_args()
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        compile_times(f"sm_{major}{minor}", args.full)
        gpu_table(args.batch, args.context, args.iters)
    else:
        compile_times(args.arch, args.full)
        print("no CUDA device: no kernel timing was taken (compile times only)")


if __name__ == "__main__":
    main()
