"""`hardware=cpu-local`: measure this machine running one model's config, cache the numbers.

The builder fills cpu-local's nulls from here for `executor=sim hardware=cpu-local`: measured on first
use, read from the cache afterwards; `python experiments/sim/calibrate.py [overrides]` re-measures and
prints. Each measurement takes a few seconds and runs what the real executor runs for the config:

- memory bandwidth: a 256 MiB tensor copy (bytes read + written per second);
- matmul FLOP/s at the model's shapes through the executor's GEMM path (`paged.model.linear.Linear`
  with the kernel `model.gemm` resolves to): every layer's linear layers (fused qkv, o, gate_up,
  down; up to 1 GiB of weights) at 1 to 2048 tokens; the best is the peak, each token count's share
  of it the `matmul_efficiency` table (so small batches come out bandwidth- and overhead-bound);
- attention: the backend and decode version the executor resolves, decode (16 sequences x 512
  tokens, bytes of K/V per second over the copy bandwidth) and prefill (512 new tokens, FLOP/s over
  the matmul peak);
- per-step overhead: a real engine built from the same config (the real executor on this CPU, FCFS
  over a naive 512-block cache) runs decode steps at 1 and 16 sequences through its public `step`;
  what a step takes beyond the cost model's compute is the host overhead, fitted as
  `step_overhead_s + seq_overhead_s x sequences`. The engine is the caller's to build (sim/ sits
  below the builder): `measure` takes a function that builds one from a config.

Norms, RoPE and SwiGLU are priced as memory traffic at the copy bandwidth (one pass each, as the
native ops make); what they cost beyond that at decode lands in the measured overhead. A CPU runs its
kernels synchronously, so a launch's cost is inside the overhead (`kernel_launch_s = 0`); the "SM
count" is torch's thread count, and interconnect and PCIe are the copy bandwidth (a single CPU has
neither). The cache is keyed by the machine, torch, the model's shape and dtype, and what the
executor runs (GEMM kernel, layer ops, attention backend, kernel version and partition size, KV
cache dtype, block-sparse pattern): a change of any re-measures.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import torch

from paged import kernels
from paged.config import (
    AllocatorConfig,
    ConfigError,
    ExecutorConfig,
    HardwareConfig,
    PluginConfig,
    SchedulerConfig,
    resolve_dtype,
)
from paged.config.choices import VERSION_RULES
from paged.executor.base import Executor
from paged.executor.model_executor import ModelExecutor
from paged.kernels.features import AttentionFeatures, BlockSparse, alibi_slopes, cache_dtype
from paged.kernels.toolchain.cache_dir import cache_root
from paged.memory.naive import NaiveAllocator
from paged.model.arch import LlamaArch
from paged.model.factory import takes_gemm_and_layer_ops
from paged.model.layer_ops import layer_ops_for
from paged.model.linear import Linear, resolve_gemm
from paged.model.spec import ModelSpec
from paged.model.weights import load_arch
from paged.request import Request, SamplingParams
from paged.scheduler.fcfs import FCFSPolicy
from paged.sim.cost_model import CostModel, StepShape
from paged.sim.hardware import resolve_hardware
from paged.utils.clock import Clock
from paged.utils.threads import cpu_name

log = logging.getLogger(__name__)

FORMAT = 2
_TOKENS = (1, 4, 16, 64, 256, 1024, 2048)
_MATMUL_BYTES = 1 << 30  # at most this much weight memory for the matmul benchmark
_BLOCK_SIZE = 16
_NUM_BLOCKS = 512  # the probe engine's cache: 16 sequences of 88 tokens need 96 blocks
_PROBE_BATCHES = (1, 16)
_PROBE_PROMPT, _PROBE_TOKENS = 64, 24
_CPU = torch.device("cpu")


class CalibrationEngine(Protocol):
    """What calibration uses of an engine: `paged.engine.engine.Engine`'s public surface."""

    executor: Executor
    clock: Clock

    def add_request(self, request: Request) -> None: ...

    def step(self, until: float | None = None, releases: bool = False) -> list[Request]: ...

    @property
    def has_unfinished(self) -> bool: ...


# builds the real engine for a config (the builder's `build_engine`)
BuildEngine = Callable[[Any], CalibrationEngine]


@dataclass(frozen=True)
class Execution:
    """What the real executor runs for a config on this CPU, resolved as `ModelExecutor` resolves it
    but without loading the weights, so that a cached calibration is found at no model load."""

    gemm: str  # torch | onednn
    layer_ops: str  # native | fused | torch: norms, RoPE, SwiGLU
    backend: kernels.KernelBackend
    version: str  # auto | vllm | v1 | v2 | v3
    partition_size: int
    kv_cache_dtype: str
    blocksparse: BlockSparse | None

    def key(self) -> dict[str, Any]:
        """The cache key's part: every choice, the backend by its name."""
        sparse = None if self.blocksparse is None else asdict(self.blocksparse)
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"backend": self.backend.name,
                                                                         "blocksparse": sparse}


def _arch(cfg: Any) -> LlamaArch:
    """The architecture of `cfg.model` (metadata only); a spec-only model has no real run to measure."""
    if cfg.model.source == "spec":
        raise ConfigError(
            f"hardware=cpu-local measures this CPU running the real model: model={cfg.model.name} is spec-only "
            "(no weights); pick a model with weights or a datasheet GPU (hardware=a100-40g, ...)"
        )
    return load_arch(cfg.model)[0]


def dtype_name(cfg: Any) -> str:
    """`cfg.model.dtype` as the real model runs it here: on this CPU (`auto` is float32 there)."""
    return resolve_dtype(cfg.model.dtype, _CPU.type)


def resolve_execution(cfg: Any, arch: LlamaArch) -> Execution:
    """What the real executor would run for `cfg` on this CPU (`Execution`)."""
    dtype, kernel = getattr(torch, dtype_name(cfg)), cfg.kernel
    llama = takes_gemm_and_layer_ops(arch)
    bloom = arch.architecture == "bloom"
    sparse = BlockSparse.from_config(dict(kernel.blocksparse)) if kernel.blocksparse else None
    backend, _ = kernels.resolve_backend(
        kernel.backend, device=_CPU, dtype=dtype, head_size=arch.head_dim, block_size=_BLOCK_SIZE,
        partition_size=None if kernel.version == "v1" else kernel.partition_size,
        cache_dtype=cache_dtype(kernel.kv_cache_dtype, dtype),
        features=AttentionFeatures(alibi_slopes(arch.num_heads) if bloom else None, sparse,
                                   arch.attn_logit_softcapping),
    )
    return Execution(
        # BLOOM keeps F.linear; Llama and Gemma take the gemm kernel (paged.model.factory)
        gemm="torch" if bloom else resolve_gemm(cfg.model.gemm, dtype, _CPU),
        layer_ops=layer_ops_for(backend).name if llama else "torch",
        backend=backend, version=kernel.version, partition_size=kernel.partition_size,
        kv_cache_dtype=kernel.kv_cache_dtype, blocksparse=sparse,
    )


def cache_path(cfg: Any) -> Path:
    """One file per (machine, threads, torch, model shape, dtype, what the executor runs)."""
    arch = _arch(cfg)
    spec = ModelSpec.from_llama(cfg.model.name, arch)
    key = json.dumps([
        FORMAT, cpu_name(), torch.get_num_threads(), torch.__version__, asdict(spec), dtype_name(cfg),
        resolve_execution(cfg, arch).key(),
    ], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / "sim" / f"cpu-local-{spec.name}-{dtype_name(cfg)}-{digest}.json"


def load_or_measure(cfg: Any, build: BuildEngine) -> dict[str, Any]:
    """The cached hardware values for `cfg`, measured (and cached) if there are none."""
    path = cache_path(cfg)
    if path.is_file():
        try:
            return json.loads(path.read_text())["hardware"]
        except (OSError, ValueError, KeyError):
            log.warning("ignoring unreadable calibration %s", path)
    log.info("hardware=cpu-local: measuring this machine for %s (cached in %s)", cfg.model.name, path)
    return measure(cfg, build, path)


def calibrated_hardware(cfg: Any, hardware: dict[str, Any], build: BuildEngine) -> dict[str, Any]:
    """`hardware` (a `calibrated` hardware's settings) with its nulls filled from the calibration."""
    measured = load_or_measure(cfg, build)
    return {key: measured.get(key) if value is None else value for key, value in hardware.items()}


def engine_config(cfg: Any) -> Any:
    """The config of the engine whose steps are timed: `cfg`'s model on this CPU with its kernel
    settings and the real executor; FCFS over a naive cache, the same for every run, so a cached
    overhead does not depend on the scheduler or allocator of the run that measured it."""
    probe = copy.deepcopy(cfg)
    probe.executor = ExecutorConfig(name="model", _target_=_path(ModelExecutor))
    probe.model.device = "cpu"
    probe.allocator = AllocatorConfig(
        name="naive", _target_=_path(NaiveAllocator), block_size=_BLOCK_SIZE, num_blocks=_NUM_BLOCKS
    )
    probe.scheduler = SchedulerConfig(name="fcfs", policy=PluginConfig(_path(FCFSPolicy)))
    return probe


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def measure(cfg: Any, build: BuildEngine, path: Path | None = None) -> dict[str, Any]:
    """Run every microbenchmark and the engine probe, write the cache file (atomically), return the
    hardware values."""
    start = time.perf_counter()
    arch = _arch(cfg)
    spec = ModelSpec.from_llama(cfg.model.name, arch)
    execution = resolve_execution(cfg, arch)
    dtype = getattr(torch, dtype_name(cfg))
    bandwidth = _copy_bandwidth()
    peak, table = _matmul(spec, dtype, execution.gemm)
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
    values |= _attention(spec, dtype, execution, bandwidth, peak)
    engine = build(engine_config(cfg))
    values |= _overhead(engine, spec, dtype, execution, values)
    record = {"hardware": values, "measured_s": time.perf_counter() - start, "cpu": cpu_name(),
              "threads": torch.get_num_threads(), "torch": torch.__version__, "execution": execution.key(),
              "engine": engine.executor.description}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    log.info("cpu-local measured in %.1f s", record["measured_s"])
    return values


def _median_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()  # warm-up: allocator, thread pool, kernel caches
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _copy_bandwidth() -> float:
    src = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / _median_time(lambda: dst.copy_(src))


def _matmul(spec: ModelSpec, dtype: torch.dtype, gemm: str) -> tuple[float, list[list[float]]]:
    """Peak FLOP/s and the efficiency per token count of the layers' linear layers, run as the
    executor runs them (`gemm`: F.linear or prepacked oneDNN)."""
    h, q, kv, inter = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size
    up = 2 * inter if spec.mlp == "gated-silu" else inter
    shapes = [(q + 2 * kv, h, spec.qkv_bias or spec.linear_bias), (h, q, spec.linear_bias),
              (up, h, spec.linear_bias), (h, inter, spec.linear_bias)]
    gen = torch.Generator().manual_seed(0)
    layer = [(torch.randn(o, i, generator=gen).to(dtype) * 0.02, torch.zeros(o, dtype=dtype) if bias else None)
             for o, i, bias in shapes]
    # every layer's own weights, as in the model: one layer's alone would sit in the CPU's caches
    # and make small batches look compute-bound
    layer_bytes = sum(w.nbytes for w, _ in layer)
    copies = max(1, min(spec.num_layers, _MATMUL_BYTES // layer_bytes))
    linears = [Linear(w.clone(), b, gemm) for _ in range(copies) for w, b in layer]
    flops_per_token = 2 * copies * sum(w.numel() for w, _ in layer)
    achieved = {}
    with torch.inference_mode():
        for tokens in _TOKENS:
            xs = [torch.randn(tokens, w.shape[1], generator=gen).to(dtype) for w, _ in layer] * copies
            seconds = _median_time(lambda xs=xs: [f(x) for f, x in zip(linears, xs)], repeats=3)
            achieved[tokens] = tokens * flops_per_token / seconds
    peak = max(achieved.values())
    return peak, [[t, min(1.0, f / peak)] for t, f in achieved.items()]


def _attention(
    spec: ModelSpec, dtype: torch.dtype, execution: Execution, bandwidth: float, peak: float
) -> dict[str, float]:
    """The executor's attention backend and decode version: decode bandwidth and prefill FLOP/s shares."""
    heads, kv_heads, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    # contexts of one partition: v1 is what `auto` runs for them, as for most decode steps
    seqs, context = 16, 512
    version = execution.version
    if version in VERSION_RULES:
        version = kernels.choose_version(context, seqs, heads, execution.partition_size)
    blocks_per_seq = context // _BLOCK_SIZE
    num_blocks = seqs * blocks_per_seq
    x = 16 // dtype.itemsize
    gen = torch.Generator().manual_seed(0)
    key_cache = torch.randn(num_blocks, kv_heads, d // x, _BLOCK_SIZE, x, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, kv_heads, d, _BLOCK_SIZE, generator=gen).to(dtype)
    tables = torch.arange(num_blocks, dtype=torch.int32).reshape(seqs, blocks_per_seq)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    query = torch.randn(seqs, heads, d, generator=gen).to(dtype)
    scale = d**-0.5
    backend = execution.backend
    with torch.inference_mode():
        decode_s = _median_time(lambda: kernels.paged_attention(
            query, key_cache, value_cache, tables, lens, scale, version=version, backend=backend,
            partition_size=execution.partition_size, max_seq_len=context,
        ))
        new = 512
        prefill_query = torch.randn(new, heads, d, generator=gen).to(dtype)
        starts = torch.tensor([0, new], dtype=torch.int32)
        prefill_s = _median_time(lambda: kernels.prefill_attention(
            prefill_query, key_cache, value_cache, tables[:1, : new // _BLOCK_SIZE], starts,
            torch.tensor([new], dtype=torch.int32), scale, backend=backend, max_query_len=new, max_seq_len=new,
        ))
    traffic = 2 * seqs * context * kv_heads * d * dtype.itemsize
    flops = 4 * d * heads * (new * (new + 1) // 2)
    return {
        "decode_attention_efficiency": min(1.0, traffic / decode_s / bandwidth),
        "prefill_attention_efficiency": min(1.0, flops / prefill_s / peak),
    }


def _overhead(
    engine: CalibrationEngine, spec: ModelSpec, dtype: torch.dtype, execution: Execution, values: dict[str, Any]
) -> dict[str, float]:
    """Host time per step and per sequence: `engine.step()` on decode steps less the modelled compute.
    The step's shape comes from the probe's own requests: a step in which every sequence, its
    prompt done and never preempted, grew by one token decoded all of them."""
    hardware = resolve_hardware(
        HardwareConfig(name="cpu-local"), {**values, "step_overhead_s": 0.0, "seq_overhead_s": 0.0}
    )
    cost = CostModel(
        spec, hardware, dtype.itemsize, version=execution.version, partition_size=execution.partition_size,
        kv_dtype_bytes=cache_dtype(execution.kv_cache_dtype, dtype).itemsize, blocksparse=execution.blocksparse,
        backend=execution.backend.name,
    )
    window = spec.sliding_window
    params = SamplingParams(max_tokens=_PROBE_TOKENS, ignore_eos=True, temperature=0.0)
    samples: dict[int, list[float]] = {}
    for batch in _PROBE_BATCHES:
        requests = [
            Request(f"calibrate-{batch}-{i}", [(7 * i + j) % 1000 + 1 for j in range(_PROBE_PROMPT)], params,
                    arrival_time=engine.clock.now())
            for i in range(batch)
        ]
        for request in requests:
            engine.add_request(request)
        seqs = [r.seqs[0] for r in requests]
        while engine.has_unfinished:
            lengths = [s.num_tokens for s in seqs]
            decoding = all(s.num_output_tokens > 0 for s in seqs)
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            grew = all(s.num_tokens == n + 1 for s, n in zip(seqs, lengths))
            if decoding and grew and not any(r.num_preemptions for r in requests):
                contexts = [n if window is None else min(n, window) for n in lengths]
                shape = StepShape(num_tokens=batch, num_sampled=batch, num_seqs=batch, decode_contexts=contexts,
                                  block_size=_BLOCK_SIZE)
                samples.setdefault(batch, []).append(elapsed - cost.step(shape).total_s)
    small, large = (statistics.median(samples[b]) for b in _PROBE_BATCHES)
    per_seq = max(0.0, (large - small) / (_PROBE_BATCHES[1] - _PROBE_BATCHES[0]))
    return {"step_overhead_s": max(0.0, small - per_seq), "seq_overhead_s": per_seq}
