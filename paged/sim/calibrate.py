"""`hardware=cpu-local`: measure this machine for one model, cache the numbers, re-measure on demand.

`python -m paged.sim.calibrate [model=NAME ...]` (Hydra overrides, as for run.py) measures and
prints; `executor=sim hardware=cpu-local` measures on first use and reads the cache afterwards.
The measurements, each under a few seconds:

- memory bandwidth: a 256 MiB tensor copy (bytes read + written per second);
- matmul FLOP/s at the model's shapes: every layer's linear layers (fused qkv, o, gate_up, down,
  as the real model runs them; up to 1 GiB of weights) at 1 to 2048 tokens; the best is the
  peak, each token count's share of it the `matmul_efficiency` table (so small batches come out
  bandwidth- and overhead-bound as measured);
- attention: the real executor's CPU kernels, decode (8 sequences x 1024 tokens, bytes of K/V per
  second over the copy bandwidth) and prefill (512 new tokens, FLOP/s over the matmul peak);
- per-step overhead: the real engine with the real model runs decode steps at 1 and 16 sequences;
  what the measured step time exceeds the cost model's compute time by is the host overhead,
  fitted as `step_overhead_s + seq_overhead_s x sequences`.

A CPU runs its kernels synchronously, so a launch's cost is inside the measured overhead
(`kernel_launch_s = 0`); the "SM count" is torch's thread count, and interconnect and PCIe are the
copy bandwidth (a single CPU has neither).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from paged.config import HardwareConfig, ModelConfig
from paged.kernels.toolchain.cache_dir import cache_root
from paged.model.spec import ModelSpec

log = logging.getLogger(__name__)

FORMAT = 1
_TOKENS = (1, 4, 16, 64, 256, 1024, 2048)
_MATMUL_BYTES = 1 << 30  # at most this much weight memory for the matmul benchmark


def _median_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()  # warm-up: allocator, thread pool, kernel caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_path(model: ModelConfig, spec: ModelSpec) -> Path:
    """One file per (machine, threads, torch, model shape, dtype)."""
    key = json.dumps(
        [FORMAT, _cpu_name(), torch.get_num_threads(), torch.__version__, asdict(spec), model.dtype], sort_keys=True
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "sim" / f"cpu-local-{spec.name}-{model.dtype}-{digest}.json"


def load_or_measure(model: ModelConfig, spec: ModelSpec) -> dict[str, Any]:
    path = cache_path(model, spec)
    if path.is_file():
        try:
            return json.loads(path.read_text())["hardware"]
        except (OSError, ValueError, KeyError):
            log.warning("ignoring unreadable calibration %s", path)
    log.info("hardware=cpu-local: measuring this machine for %s (once; cached in %s)", spec.name, path)
    return measure(model, spec, path)


def measure(model: ModelConfig, spec: ModelSpec, path: Path | None = None) -> dict[str, Any]:
    """Run every microbenchmark, write the cache file (atomically), return the hardware values."""
    start = time.perf_counter()
    dtype = getattr(torch, model.dtype)
    bandwidth = _copy_bandwidth()
    peak, table = _matmul(spec, dtype)
    values: dict[str, Any] = {
        "memory_bandwidth": bandwidth,
        "flops_fp32" if dtype == torch.float32 else "flops_fp16": peak,
        "flops_fp32" if dtype != torch.float32 else "flops_fp16": peak,
        "matmul_efficiency": table,
        "memory": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "interconnect_bandwidth": bandwidth,
        "pcie_bandwidth": bandwidth,
        "num_sms": torch.get_num_threads(),
        "memory_efficiency": 1.0,  # the copy above is the achieved bandwidth already
        "kernel_launch_s": 0.0,
    }
    values |= _attention(spec, dtype, bandwidth, peak)
    values |= _overhead(model, spec, values)
    record = {"hardware": values, "measured_s": time.perf_counter() - start, "cpu": _cpu_name(),
              "threads": torch.get_num_threads(), "torch": torch.__version__}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    log.info("cpu-local measured in %.1f s", record["measured_s"])
    return values


def _copy_bandwidth() -> float:
    src = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _median_time(lambda: dst.copy_(src))


def _matmul(spec: ModelSpec, dtype: torch.dtype) -> tuple[float, list[list[float]]]:
    """Peak FLOP/s and the efficiency per token count of one layer's linear layers."""
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    up = 2 * inter if spec.mlp == "gated-silu" else inter
    shapes = [(q + 2 * kv, h), (h, q), (up, h), (h, inter)]
    gen = torch.Generator().manual_seed(0)
    layer = [torch.randn(o, i, generator=gen).to(dtype) * 0.02 for o, i in shapes]
    # every layer's own weights, as in the model: one layer's alone would sit in the CPU's caches
    # and make small batches look compute-bound
    layer_bytes = sum(w.nbytes for w in layer)
    copies = max(1, min(spec.num_layers, _MATMUL_BYTES // layer_bytes))
    weights = [w.clone() for _ in range(copies) for w in layer]
    achieved = {}
    with torch.inference_mode():
        for tokens in _TOKENS:
            xs = [torch.randn(tokens, w.shape[1], generator=gen).to(dtype) for w in layer] * copies
            seconds = _median_time(lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, weights)], repeats=3)
            achieved[tokens] = 2 * tokens * sum(w.numel() for w in weights) / seconds
    peak = max(achieved.values())
    return peak, [[t, min(1.0, f / peak)] for t, f in achieved.items()]


def _attention(spec: ModelSpec, dtype: torch.dtype, bandwidth: float, peak: float) -> dict[str, float]:
    """The real executor's CPU attention kernels: decode bandwidth and prefill FLOP/s shares."""
    from paged import kernels

    block_size, heads, kv_heads, d = 16, spec.num_heads, spec.num_kv_heads, spec.head_dim
    backend, _ = kernels.resolve_backend(
        "auto", device=torch.device("cpu"), dtype=dtype, head_size=d, block_size=block_size, partition_size=None
    )
    seqs, context = 8, 1024
    blocks_per_seq = context // block_size
    num_blocks = seqs * blocks_per_seq
    x = 16 // dtype.itemsize
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.randn(num_blocks, kv_heads, d // x, block_size, x, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, kv_heads, d, block_size, generator=gen).to(dtype)
    tables = torch.arange(num_blocks, dtype=torch.int32).reshape(seqs, blocks_per_seq)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    query = torch.randn(seqs, heads, d, generator=gen).to(dtype)
    scale = d**-0.5
    with torch.inference_mode():
        decode_s = _median_time(lambda: kernels.paged_attention(
            query, key_cache, value_cache, tables, lens, scale, version="v1", backend=backend, max_seq_len=context
        ))
        new = 512
        prefill_query = torch.randn(new, heads, d, generator=gen).to(dtype)
        starts = torch.tensor([0, new], dtype=torch.int32)
        prefill_s = _median_time(lambda: kernels.prefill_attention(
            prefill_query, key_cache, value_cache, tables[:1, : new // block_size], starts,
            torch.tensor([new], dtype=torch.int32), scale, backend=backend, max_query_len=new, max_seq_len=new,
        ))
    traffic = 2 * seqs * context * kv_heads * d * dtype.itemsize
    flops = 4 * d * heads * (new * (new + 1) // 2)
    return {
        "decode_attention_efficiency": min(1.0, traffic / decode_s / bandwidth),
        "prefill_attention_efficiency": min(1.0, flops / prefill_s / peak),
    }


def _overhead(model: ModelConfig, spec: ModelSpec, values: dict[str, Any]) -> dict[str, float]:
    """Host time per step and per sequence: the real engine's decode steps less the modelled compute."""
    from paged.config import AllocatorConfig, KernelConfig, SchedulerConfig
    from paged.executor.model_executor import ModelExecutor
    from paged.memory import BlockManager
    from paged.memory.naive import NaiveAllocator
    from paged.request import Request, SamplingParams
    from paged.scheduler.core import Scheduler
    from paged.scheduler.fcfs import FCFSPolicy
    from paged.sim.cost_model import CostModel, step_shape
    from paged.sim.hardware import resolve_hardware

    kernel = KernelConfig(name="auto")
    executor = ModelExecutor(model, kernel)
    hardware = resolve_hardware(
        HardwareConfig(name="cpu-local"), {**values, "step_overhead_s": 0.0, "seq_overhead_s": 0.0}
    )
    cost = CostModel(spec, hardware, getattr(torch, model.dtype).itemsize)
    alloc_cfg = AllocatorConfig(name="naive", _target_="", num_blocks=512)
    samples: dict[int, list[float]] = {}
    for batch in (1, 16):
        executor.init_kv_cache(alloc_cfg.num_blocks, alloc_cfg.block_size)
        manager = BlockManager(NaiveAllocator(alloc_cfg.num_blocks, alloc_cfg.block_size))
        scheduler = Scheduler(SchedulerConfig(name="fcfs"), manager, FCFSPolicy(), eos_token_ids=())
        for i in range(batch):
            params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
            scheduler.add_request(Request(f"cal-{batch}-{i}", [(7 * i + j) % 1000 + 1 for j in range(64)], params))
        while scheduler.has_unfinished:
            start = time.perf_counter()
            sched = scheduler.schedule(start)
            output = executor.execute(sched)
            scheduler.update_from_output(sched, output, start)
            scheduler.stats()  # the engine records the cache's state every step
            elapsed = time.perf_counter() - start
            if not sched.is_prefill and len(sched.scheduled) == batch:
                samples.setdefault(batch, []).append(elapsed - cost.step(step_shape(sched)).total_s)
    small, large = statistics.median(samples[1]), statistics.median(samples[16])
    per_seq = max(0.0, (large - small) / 15)
    return {"step_overhead_s": max(0.0, small - per_seq), "seq_overhead_s": per_seq}


def main(argv: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    from paged.config import compose_config
    from paged.sim.executor import model_spec

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = compose_config(["executor=sim", "hardware=cpu-local", *argv])
    spec, _ = model_spec(cfg.model)
    path = cache_path(cfg.model, spec)
    values = measure(cfg.model, spec, path)
    table = Table(title=f"cpu-local for {spec.name} ({cfg.model.dtype}), {torch.get_num_threads()} threads")
    table.add_column("value")
    table.add_column("measured", justify="right")
    for key, value in values.items():
        shown = ", ".join(f"{t:g}:{e:.2f}" for t, e in value) if key == "matmul_efficiency" else f"{value:.4g}"
        table.add_row(key, shown)
    Console().print(table)
    print(f"cached in {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
