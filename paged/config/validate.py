"""Range and choice checks that a type cannot express, one function per config group.

`validate` runs them all on a composed config and returns the byte sizes it parsed, so the builder
sizes the cache and the swap pool from them without parsing again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged.config.choices import (
    BACKENDS,
    BATCH_ORDERS,
    BLOCK_SIZES,
    CLUSTER_BACKENDS,
    GEMMS,
    KV_CACHE_DTYPES,
    LOGGER_BACKENDS,
    LOGGER_MODES,
    MAX_NUM_REQUESTS,
    MODEL_DEVICES,
    MODEL_DTYPES,
    MODEL_SOURCES,
    PREEMPTION_MODES,
    VERSION_RULES,
    VERSIONS,
    WORKLOAD_KINDS,
)
from paged.config.kernel_options import BlockSparseSpec, check_scale
from paged.config.keys import check_keys
from paged.config.schema import ConfigError
from paged.config.units import parse_bytes
from paged.kv_layout import KV_GROUP_MODES


@dataclass(frozen=True)
class ByteSizes:
    """The allocator's byte settings, parsed: `kv_cache_memory` (None: not set) and `swap_space`."""

    kv_cache_memory: int | None
    swap_space: int


def validate(cfg: Any, block_sizes: tuple[int, ...] = BLOCK_SIZES) -> ByteSizes:
    """Every group's checks on a composed config (a DictConfig or a `Config`), its keys first;
    `block_sizes` are those the executor runs (the kernels' by default)."""
    check_keys(cfg)
    sizes = check_allocator(cfg.allocator, block_sizes)
    check_scheduler(cfg.scheduler, cfg.allocator.block_size)
    check_kernel(cfg.kernel, cfg.allocator.block_size)
    check_model(cfg.model)
    _positive("hardware.num_gpus", cfg.hardware.num_gpus)
    check_workload(cfg.workload)
    check_lengths(cfg.workload, cfg.scheduler.max_model_len)
    check_logger(cfg.logger)
    check_cluster(cfg.cluster)
    check_slo(cfg.slo)
    check_server(cfg.server)
    return sizes


def _choice(key: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not supported; allowed: {', '.join(map(str, allowed))}")


def _positive(key: str, value: float | int | None, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{key}={value!r} must be > 0")


def check_allocator(a: Any, block_sizes: tuple[int, ...] = BLOCK_SIZES) -> ByteSizes:
    _choice("allocator.block_size", a.block_size, block_sizes)
    _positive("allocator.num_blocks", a.num_blocks, allow_none=True)
    kv_cache_memory = None
    if a.kv_cache_memory is not None:
        kv_cache_memory = parse_bytes(a.kv_cache_memory)
        if a.num_blocks is not None:
            # with both set, num_blocks would silently win over the budget the user gave
            raise ConfigError(
                f"allocator.num_blocks={a.num_blocks} and allocator.kv_cache_memory={a.kv_cache_memory!r} both size "
                "the KV cache; set allocator.num_blocks=null to size it by memory, or drop kv_cache_memory"
            )
    if not 0.0 < a.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"allocator.gpu_memory_utilization={a.gpu_memory_utilization!r} must be in (0, 1]")
    if not 0.0 <= a.watermark < 1.0:
        raise ConfigError(f"allocator.watermark={a.watermark!r} must be in [0, 1)")
    _choice("allocator.kv_groups", a.kv_groups, KV_GROUP_MODES)
    return ByteSizes(kv_cache_memory, parse_bytes(a.swap_space, key="allocator.swap_space"))


def check_scheduler(s: Any, block_size: int) -> None:
    _choice("scheduler.preemption_mode", s.preemption_mode, PREEMPTION_MODES)
    for key in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        _positive(f"scheduler.{key}", getattr(s, key))
    _choice("scheduler.batch_order", s.batch_order, BATCH_ORDERS)
    _positive("scheduler.max_num_partial_prefills", s.max_num_partial_prefills)
    if s.long_prefill_token_threshold < 0:
        raise ConfigError(
            f"scheduler.long_prefill_token_threshold={s.long_prefill_token_threshold!r} must be >= 0 "
            "(0: a chunk is capped by the token budget only)"
        )
    if s.max_num_batched_tokens < block_size:
        raise ConfigError(
            f"scheduler.max_num_batched_tokens={s.max_num_batched_tokens} is below one KV block "
            f"(allocator.block_size={block_size}); a step must be able to fill a block"
        )
    if s.max_num_batched_tokens < s.max_model_len and not s.chunked_prefill:
        # without chunks a prompt (or a recomputed sequence) runs in one step: the budget must hold the longest
        raise ConfigError(
            f"scheduler.max_num_batched_tokens={s.max_num_batched_tokens} must be >= "
            f"scheduler.max_model_len={s.max_model_len} when scheduler.chunked_prefill=false "
            "(chunked prefill runs longer prompts in several steps)"
        )


def check_kernel(k: Any, block_size: int) -> None:
    _choice("kernel.version", k.version, (*VERSION_RULES, *VERSIONS))
    _choice("kernel.backend", k.backend, ("auto", *BACKENDS))
    _positive("kernel.partition_size", k.partition_size)
    if k.partition_size % block_size:
        raise ConfigError(
            f"kernel.partition_size={k.partition_size} must be a multiple of allocator.block_size={block_size}"
        )
    _choice("kernel.kv_cache_dtype", k.kv_cache_dtype, ("auto", *KV_CACHE_DTYPES))
    for key in ("k_scale", "v_scale"):
        try:
            check_scale(f"kernel.{key}", getattr(k, key))
        except ValueError as err:
            raise ConfigError(f"{err} (null: calibrated from the first prefill)") from err
    if k.blocksparse is not None:
        _check_blocksparse(k.blocksparse, block_size)


def _check_blocksparse(values: Any, cache_block_size: int) -> None:
    try:
        sparse = BlockSparseSpec.from_config(values)  # its errors name kernel.blocksparse and the allowed keys
    except ValueError as err:
        raise ConfigError(str(err)) from err
    try:
        sparse.check(cache_block_size)
    except ValueError as err:
        raise ConfigError(f"kernel.blocksparse: {err}; allocator.block_size={cache_block_size}") from err


def check_model(m: Any) -> None:
    _choice("model.source", m.source, MODEL_SOURCES)
    _choice("model.dtype", m.dtype, MODEL_DTYPES)
    _choice("model.device", m.device, MODEL_DEVICES)
    _choice("model.gemm", m.gemm, GEMMS)
    if m.source == "hf" and not m.path:
        raise ConfigError("model=hf needs model.path=/path/to/a/local/hf/checkpoint")
    if m.source == "spec" and not m.arch:
        raise ConfigError(f"model={m.name} has source=spec but no model.arch describing its shape")
    window = m.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ConfigError(
            f"model.sliding_window={window!r} must be a positive number of tokens, or null for the checkpoint's own"
        )
    threads = m.num_threads
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(
            f"model.num_threads={threads!r} must be an int >= 1, or null for the cores this process may use"
        )


def check_workload(w: Any) -> None:
    _choice("workload.kind", w.kind, WORKLOAD_KINDS)
    if w.num_requests is None and w.kind not in ("trace", "multiturn", "agent"):
        raise ConfigError(
            "workload.num_requests=null (the whole trace; multiturn, agent: no cap on the turns) is only allowed "
            f"for workload=trace, multiturn or agent; workload={w.kind} needs a count > 0"
        )
    _positive("workload.num_requests", w.num_requests, allow_none=True)
    if w.num_requests is not None and w.num_requests > MAX_NUM_REQUESTS:
        raise ConfigError(
            f"workload.num_requests={w.num_requests} is more than {MAX_NUM_REQUESTS:,}, the most one run builds "
            "(every request's token ids are held in memory before the run starts)"
        )
    if w.kind in ("prompts", "trace") and not w.path:
        raise ConfigError(f"workload={w.kind} needs workload.path=FILE")
    if w.arrival_rate < 0:
        raise ConfigError(
            f"workload.arrival_rate={w.arrival_rate!r} must be >= 0 (requests/s; 0 submits all at once)"
        )
    if w.kind == "fixed":
        _positive("workload.prompt_len", w.prompt_len)
        _positive("workload.output_len", w.output_len)
        if not 0 <= w.shared_prefix_len <= w.prompt_len:
            raise ConfigError(
                f"workload.shared_prefix_len={w.shared_prefix_len!r} must be in [0, workload.prompt_len="
                f"{w.prompt_len}] for workload=fixed"
            )
    if w.num_prefixes < 1:
        raise ConfigError(f"workload.num_prefixes={w.num_prefixes!r} must be >= 1 (1: one prefix shared by all)")
    if w.num_prefixes > 1 and w.shared_prefix_len <= 0:
        raise ConfigError(
            f"workload.num_prefixes={w.num_prefixes} needs workload.shared_prefix_len > 0, got "
            f"{w.shared_prefix_len}: there is no prefix to vary"
        )
    _check_clients(w)
    if w.num_priorities < 0:
        raise ConfigError(
            f"workload.num_priorities={w.num_priorities!r} must be >= 0 (0: every request's priority is 0)"
        )


def check_lengths(w: Any, max_model_len: int) -> None:
    """Lengths the user gives must fit `scheduler.max_model_len` (a request's prompt and output
    together, as the engine requires): a fixed workload's exact lengths, and for the sampled kinds the
    shortest request their minimums allow. Sampled lengths over it are clipped, with a warning
    (`paged.workload.lengths`); a prompt file's requests are judged one by one by the engine."""
    limit = f"scheduler.max_model_len={max_model_len}"
    if w.kind in ("prompts", "fixed"):
        if w.kind == "fixed" and w.prompt_len + w.output_len > max_model_len:
            raise ConfigError(
                f"workload.prompt_len={w.prompt_len} + workload.output_len={w.output_len} = "
                f"{w.prompt_len + w.output_len} tokens per request, more than {limit}; raise scheduler.max_model_len "
                "or shorten them"
            )
        return
    if w.shared_prefix_len >= max_model_len:
        raise ConfigError(
            f"workload.shared_prefix_len={w.shared_prefix_len} leaves no room to generate: it must be < {limit}"
        )
    shortest = w.shared_prefix_len + w.prompt_len_min + w.output_len_min
    if shortest > max_model_len:
        raise ConfigError(
            f"workload.shared_prefix_len={w.shared_prefix_len} + workload.prompt_len_min={w.prompt_len_min} + "
            f"workload.output_len_min={w.output_len_min} = {shortest} tokens, more than {limit}: "
            f"no request of workload={w.name} would fit"
        )


def _check_clients(w: Any) -> None:
    if w.num_clients < 0:
        raise ConfigError(f"workload.num_clients={w.num_clients!r} must be >= 0 (0: requests name no client)")
    if w.tenant_prefixes and (w.num_clients == 0 or w.num_prefixes < 2):
        raise ConfigError(
            f"workload.tenant_prefixes=true gives each client its own prefix: it needs workload.num_clients > 0 and "
            f"workload.num_prefixes > 1, got {w.num_clients} and {w.num_prefixes}"
        )
    if w.client_weights is None:
        return
    weights = list(w.client_weights)
    if w.num_clients == 0:
        raise ConfigError(f"workload.client_weights={weights} needs workload.num_clients > 0 (one weight per client)")
    if len(weights) != w.num_clients:
        raise ConfigError(
            f"workload.client_weights={weights} must have one weight per client: "
            f"{w.num_clients} (workload.num_clients), got {len(weights)}"
        )
    if min(weights) < 0 or sum(weights) <= 0:
        raise ConfigError(
            f"workload.client_weights={weights} must all be >= 0 with a sum > 0 (relative request shares)"
        )


def check_logger(lg: Any) -> None:
    _choice("logger.backend", lg.backend, LOGGER_BACKENDS)
    _choice("logger.mode", lg.mode, LOGGER_MODES)


def check_cluster(c: Any) -> None:
    """Replica counts and where replicas run; the two disaggregated pools come together or not at all."""
    _positive("cluster.num_replicas", c.num_replicas)
    _choice("cluster.backend", c.backend, CLUSTER_BACKENDS)
    if c.num_cpus_per_replica <= 0:
        raise ConfigError(f"cluster.num_cpus_per_replica={c.num_cpus_per_replica} must be > 0")
    for key in ("prefill_replicas", "decode_replicas"):
        if getattr(c, key) < 0:
            raise ConfigError(f"cluster.{key}={getattr(c, key)} must be >= 0 (0: no disaggregation)")
    if (c.prefill_replicas > 0) != (c.decode_replicas > 0):
        raise ConfigError(
            f"cluster.prefill_replicas={c.prefill_replicas} and cluster.decode_replicas={c.decode_replicas}: "
            "disaggregation needs both pools (> 0), or neither (0)"
        )


def check_server(server: Any) -> None:
    """A host to bind and a TCP port (0: any free one)."""
    if not server.host:
        raise ConfigError("server.host is empty: give an address to listen on (127.0.0.1: this machine only)")
    if not 0 <= server.port <= 65535:
        raise ConfigError(f"server.port={server.port} must be in [0, 65535] (0: a free port)")
    if server.served_model_name is not None and not server.served_model_name:
        raise ConfigError("server.served_model_name is empty: give a name, or null for model.name")


def check_slo(slo: Any) -> None:
    """Each objective is a positive number of seconds, or null (none)."""
    _positive("slo.ttft_s", slo.ttft_s, allow_none=True)
    _positive("slo.tpot_s", slo.tpot_s, allow_none=True)
