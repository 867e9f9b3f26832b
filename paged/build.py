"""Turn a composed config into a running engine: executor, allocator, block manager, policy."""

from __future__ import annotations

import logging
from typing import Any

from paged.config import ConfigError, parse_bytes, validate
from paged.engine import Engine
from paged.memory import BlockAllocator, BlockManager
from paged.registry import load_object
from paged.scheduler.core import Scheduler
from paged.scheduler.policy import SchedulingPolicy

log = logging.getLogger(__name__)


def _plugin(path: str, key: str, base: type, *args: Any, **kwargs: Any) -> Any:
    try:
        cls = load_object(path)
    except ValueError as e:
        raise ConfigError(f"{key}={path!r}: {e}") from None
    obj = cls(*args, **kwargs)
    if not isinstance(obj, base):
        raise ConfigError(f"{key}={path!r} builds a {type(obj).__name__}, which is not a {base.__name__}")
    return obj


def num_blocks_for(cfg: Any, bytes_per_block: int) -> int:
    """`allocator.num_blocks`, or the byte budget `allocator.kv_cache_memory` over the block size."""
    if cfg.allocator.num_blocks is not None:
        return int(cfg.allocator.num_blocks)
    budget = parse_bytes(cfg.allocator.kv_cache_memory)
    num_blocks = budget // bytes_per_block
    if num_blocks <= 0:
        raise ConfigError(
            f"allocator.kv_cache_memory={cfg.allocator.kv_cache_memory!r} holds no block "
            f"(one block takes {bytes_per_block} bytes)"
        )
    return num_blocks


def build_scheduler(cfg: Any, num_blocks: int) -> Scheduler:
    allocator = _plugin(
        cfg.allocator.cls, "allocator.cls", BlockAllocator, num_blocks=num_blocks, block_size=cfg.allocator.block_size
    )
    block_manager = BlockManager(allocator, watermark=cfg.allocator.watermark)
    policy = _plugin(cfg.scheduler.policy, "scheduler.policy", SchedulingPolicy, cfg.scheduler)
    return Scheduler(cfg.scheduler, block_manager, policy)


def build_executor(cfg: Any) -> Any:
    from paged.executor.model_executor import ModelExecutor

    return ModelExecutor(cfg.model, cfg.kernel, seed=cfg.seed)


def build_engine(cfg: Any, executor: Any | None = None) -> Engine:
    """Validate `cfg`, load the model (unless an executor is given) and wire the engine."""
    validate(cfg)
    if executor is None:
        executor = build_executor(cfg)
    elif hasattr(executor, "configure_kernel"):
        executor.configure_kernel(cfg.kernel)
    num_blocks = num_blocks_for(cfg, executor.bytes_per_block(cfg.allocator.block_size))
    executor.init_kv_cache(num_blocks, cfg.allocator.block_size)
    scheduler = build_scheduler(cfg, num_blocks)
    log.info(
        "KV cache: %d blocks of %d tokens (%d tokens); allocator %s, policy %s",
        num_blocks, cfg.allocator.block_size, num_blocks * cfg.allocator.block_size,
        cfg.allocator.name, cfg.scheduler.name,
    )
    return Engine(executor, scheduler)
