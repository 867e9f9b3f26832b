"""summary.json (DESIGN.md contract): one flat dict per run, from its config and the engine after it ran.

`run.py`'s runs, the experiments' quiet runs and the scripts that drive an `LLM` all summarize here,
so a key means the same wherever it appears."""

from __future__ import annotations

from typing import Any

from paged.cluster.fleet import Fleet
from paged.engine.engine import Engine
from paged.memory.eviction import POLICIES
from paged.step import KVStats


def summarize(
    cfg: Any,
    engine: Engine | Fleet,
    *,
    host_time_s: float | None = None,
    load_time_s: float | None = None,
    num_not_started: int = 0,
    interrupted: bool = False,
) -> dict[str, Any]:
    """The engine's metrics, what ran, the KV pool's size and the swap counters. `host_time_s` is the
    host seconds the run took and `load_time_s` those building the engine took (None: not measured).
    A run stopped early (`interrupted`) left `num_not_started` of its requests unsubmitted: they
    count in `num_requests`, beside `num_finished` and `num_aborted`.

    A fleet's metrics are over all its requests and its KV keys over all its pools; `replicas`
    holds a row per replica (requests, hit rate, KV usage), and every run has `num_replicas` and
    `router` (null for one engine)."""
    kv, classes, executor = engine.kv_stats(), engine.plugin_classes(), engine.executor
    block_size = cfg.allocator.block_size
    bytes_per_block = executor.kv_cache_spec(block_size).bytes_per_block
    counters = engine.counters
    metrics = engine.metrics.summary(
        kv_end=kv, caches_prefixes=engine.caches_prefixes, slo_ttft_s=cfg.slo.ttft_s, slo_tpot_s=cfg.slo.tpot_s,
        bytes_per_block=bytes_per_block,
    )
    # every run has `interrupted` and `num_not_started`, so that a sweep's summaries share one schema
    summary = {
        "interrupted": interrupted,
        **metrics,
        "num_requests": metrics["num_requests"] + num_not_started,
        "num_not_started": num_not_started,
    }
    summary |= {
        "allocator": cfg.allocator.name,
        "allocator_class": classes["allocator"],
        "policy": cfg.scheduler.name,
        "policy_class": classes["policy"],
        "preemption_class": classes["preemption"],
        "executor": cfg.executor.name,
        "executor_class": classes["executor"],
        "executor_description": executor.description,
        "attention_kernel": executor.kernel_description,
        # the host threads the model ran on (null: no model ran, executor=sim)
        "num_threads": executor.threads.num_threads if executor.threads is not None else None,
        # the devices one engine's model and KV cache are split over (executor=sim: hardware.num_gpus)
        "tensor_parallel_size": executor.num_devices,
        "block_size": block_size,
        "host_time_s": host_time_s,
        "load_time_s": load_time_s,  # building the engine (weights, KV cache): not part of any latency
        # the KV pool's size: token slots (Table 1's "max. # KV cache slots") and bytes
        "kv_token_slots": kv.num_total_blocks * block_size,
        "kv_cache_bytes": kv.num_total_blocks * bytes_per_block,
        # KV groups per layer type: the mode asked for, and the groups the model's layers made
        "kv_groups": cfg.allocator.kv_groups,
        "num_kv_groups": executor.kv_layout.num_groups if executor.kv_layout is not None else 1,
        # swap preemption's counters; `swap_bytes` counts both directions
        "preemption_mode": cfg.scheduler.preemption_mode if cfg.scheduler.preemption.get("_target_") is None
        else classes["preemption"],
        "num_swaps_out": counters.num_swaps_out,
        "num_swaps_in": counters.num_swaps_in,
        "swap_bytes": counters.num_swapped_blocks * bytes_per_block,
        "num_swap_fallbacks": engine.num_swap_fallbacks,
        # the prefix cache's eviction policy (allocator/eviction; null without a prefix cache) and its evictions
        "eviction_policy": _eviction_policy(cfg) if engine.caches_prefixes else None,
        "num_evictions": kv.num_evictions,
        **_tier_summary(kv, bytes_per_block),
        **executor.decode_step_counts(),
        # steps launched before the previous one's tokens were read (scheduler.async_scheduling resolved)
        "async_scheduling": getattr(executor, "async_scheduling", False),
        "num_replicas": len(engine.replicas) if isinstance(engine, Fleet) else 1,
        "router": cfg.router.name if isinstance(engine, Fleet) else None,
    }
    if isinstance(engine, Engine):
        summary |= engine.kv_press_summary()  # KV compression's counters, only when a press ran
    if isinstance(engine, Fleet):
        summary |= {"router_class": classes["router"], "replicas": engine.replica_rows()}
    if engine.clock.simulated:
        # latencies and wall_time_s above are simulated seconds
        summary |= {
            "sim_time_s": summary["wall_time_s"],
            "sim_seconds_per_host_second": summary["wall_time_s"] / host_time_s if host_time_s else None,
            "hardware": cfg.hardware.name,
            "num_gpus": cfg.hardware.num_gpus,
        }
    return summary


def _eviction_policy(cfg: Any) -> str:
    """The config name of the built-in policy `allocator.eviction._target_` names, else that path."""
    target = cfg.allocator.eviction._target_
    return next((name for name, cls in POLICIES.items() if f"{cls.__module__}.{cls.__qualname__}" == target), target)


def _tier_summary(kv_end: KVStats, bytes_per_block: int) -> dict[str, Any]:
    """The tiers for evicted prefixes (`allocator.offload`; zeros when off): prompt tokens each tier
    served as prefix hits (device + cpu + disk = the hits of `prefix_cache_hit_rate`), tokens served
    from a lower tier instead of recomputed, and the bytes moved between the device and host memory
    and to and from disk, with the disk blocks found missing or corrupt (each a miss)."""
    lower = kv_end.num_hit_tokens_cpu + kv_end.num_hit_tokens_disk
    return {
        "prefix_hit_tokens_device": kv_end.num_hit_tokens - lower,
        "prefix_hit_tokens_cpu": kv_end.num_hit_tokens_cpu,
        "prefix_hit_tokens_disk": kv_end.num_hit_tokens_disk,
        "recompute_avoided_tokens": lower,
        "kv_offload_bytes": kv_end.num_offload_blocks * bytes_per_block,
        "kv_onload_bytes": kv_end.num_onload_blocks * bytes_per_block,
        "kv_disk_write_bytes": kv_end.num_disk_write_blocks * bytes_per_block,
        "kv_disk_read_bytes": kv_end.num_disk_read_blocks * bytes_per_block,
        "kv_disk_bad_blocks": kv_end.num_disk_bad_blocks,
    }
