"""One experiment from a composed config: build, run the workload, write outputs, log to W&B."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from paged.builder import build_engine
from paged.config import compose_config
from paged.engine import Engine
from paged.outputs import print_summary, write_outputs
from paged.runner import run_workload
from paged.wandb_logger import WandbLogger
from paged.workload import WorkloadItem, load_workload

log = logging.getLogger(__name__)


def run_experiment(
    cfg: Any, run_dir: Path, *, group: str | None = None, name: str | None = None, tags: list[str] | None = None
) -> dict[str, Any]:
    load_start = time.perf_counter()
    engine = build_engine(cfg)
    load_time = time.perf_counter() - load_start
    executor, scheduler = engine.executor, engine.scheduler
    items = workload_for(cfg, engine)
    config = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(cfg)
    wb = WandbLogger(
        cfg.logger, run_dir, config, group=group, name=name,
        job_type=f"{cfg.allocator.name}/{cfg.scheduler.name}/{cfg.kernel.name}",
        simulated=engine.clock.simulated, tags=tags,
    )
    engine.metrics.step_listeners.append(wb.log_step)
    host_start = time.perf_counter()
    requests = run_workload(engine, items, progress=cfg.progress)
    host_time = time.perf_counter() - host_start
    allocator = scheduler.block_manager.allocator
    summary = engine.metrics.summary(
        kv_end=scheduler.block_manager.stats(), caches_prefixes=allocator.caches_prefixes
    )
    summary |= {
        "allocator": cfg.allocator.name,
        "allocator_class": _qualname(allocator),
        "policy": cfg.scheduler.name,
        "policy_class": _qualname(scheduler.policy),
        "preemption_class": _qualname(scheduler.preemption),
        "executor": cfg.executor.name,
        "executor_class": _qualname(executor),
        "executor_description": executor.description,
        "attention_kernel": executor.kernel_description,
        "block_size": cfg.allocator.block_size,
        "host_time_s": host_time,
        "load_time_s": load_time,  # building the engine (weights, KV cache): not part of any latency
        **pool_summary(cfg, engine),
        **swap_summary(cfg, engine),
    }
    if engine.clock.simulated:
        # latencies and wall_time_s above are simulated seconds
        summary |= {
            "sim_time_s": summary["wall_time_s"],
            "sim_seconds_per_host_second": summary["wall_time_s"] / host_time if host_time > 0 else None,
            "hardware": cfg.hardware.name,
            "num_gpus": cfg.hardware.num_gpus,
        }
    decode = executor.tokenizer.decode if executor.tokenizer is not None else None
    write_outputs(run_dir, summary, requests, engine.metrics.request_metrics(), decode)
    wb.finish(summary, engine.metrics.request_metrics(), run_dir)
    title = f"paged: {cfg.allocator.name} | {cfg.scheduler.name} | {executor.description}"
    print_summary(summary, title)
    log.info("wrote %s", run_dir)
    return summary


def pool_summary(cfg: Any, engine: Engine) -> dict[str, int]:
    """The KV pool's size: token slots (Table 1's "max. # KV cache slots") and bytes."""
    num_blocks, block_size = engine.scheduler.block_manager.stats().num_total_blocks, cfg.allocator.block_size
    return {
        "kv_token_slots": num_blocks * block_size,
        "kv_cache_bytes": num_blocks * engine.executor.kv_cache_spec(block_size).bytes_per_block,
    }


def swap_summary(cfg: Any, engine: Engine) -> dict[str, Any]:
    """Swap preemption's counters; `swap_bytes` counts both directions."""
    counters, preemption = engine.scheduler.counters, engine.scheduler.preemption
    bytes_per_block = engine.executor.kv_cache_spec(cfg.allocator.block_size).bytes_per_block
    return {
        "preemption_mode": cfg.scheduler.preemption_mode if cfg.scheduler.preemption.get("_target_") is None
        else _qualname(preemption),
        "num_swaps_out": counters.num_swaps_out,
        "num_swaps_in": counters.num_swaps_in,
        "swap_bytes": counters.num_swapped_blocks * bytes_per_block,
        "num_swap_fallbacks": preemption.num_recompute_fallbacks,
    }


def run_quietly(overrides: list[str]) -> tuple[dict[str, Any], Engine]:
    """The experiment scripts' run: compose `overrides` (no logger, no progress bar), build, run the
    workload, and return the summary (with the swap counters) and the engine; nothing is written."""
    cfg = compose_config(["logger=none", "progress=false", *overrides])
    engine = build_engine(cfg)
    run_workload(engine, workload_for(cfg, engine), progress=False)
    bm = engine.scheduler.block_manager
    summary = engine.metrics.summary(kv_end=bm.stats(), caches_prefixes=bm.allocator.caches_prefixes)
    return summary | pool_summary(cfg, engine) | swap_summary(cfg, engine), engine


def workload_for(cfg: Any, engine: Engine) -> list[WorkloadItem]:
    """`cfg.workload`'s requests in the executor's vocabulary, clipped to the scheduler's max length."""
    executor = engine.executor
    return load_workload(
        cfg.workload, executor.tokenizer, vocab_size=executor.vocab_size, max_model_len=cfg.scheduler.max_model_len
    )


def _qualname(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
