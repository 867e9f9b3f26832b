"""Turn a composed config into a running engine.

Every pluggable part is named by `_target_` and built by `hydra.utils.instantiate`. All of them
are checked first (import, base type, settings) and the cheap ones are constructed before the
executor loads any weights, so a bad plugin setting costs no model load.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from paged.config import AllocatorConfig, ConfigError, ExecutorConfig, parse_bytes, validate
from paged.engine import Engine
from paged.executor.base import Executor
from paged.memory import BlockAllocator, BlockManager, Reservation
from paged.plugins import Plugin, check_plugin
from paged.scheduler.core import Scheduler
from paged.scheduler.policy import SchedulingPolicy
from paged.scheduler.preemption import PreemptionMode

log = logging.getLogger(__name__)


def _core_keys(schema: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(schema))


@dataclass(frozen=True)
class Plugins:
    """The checked pluggable parts of one config."""

    allocator: Plugin
    reservation: Plugin
    policy: Plugin
    preemption: Plugin
    executor: Plugin


def check_config(cfg: Any) -> Plugins:
    """Range checks on the core keys, then every plugin's class and settings; builds nothing."""
    validate(cfg)
    return Plugins(
        allocator=check_plugin(
            cfg.allocator, "allocator", BlockAllocator,
            core=_core_keys(AllocatorConfig), provided=("num_blocks", "block_size"),
        ),
        reservation=check_plugin(cfg.allocator.reservation, "allocator.reservation", Reservation),
        policy=check_plugin(cfg.scheduler.policy, "scheduler.policy", SchedulingPolicy),
        preemption=check_plugin(cfg.scheduler.preemption, "scheduler.preemption", PreemptionMode),
        executor=check_plugin(
            cfg.executor, "executor", Executor,
            core=_core_keys(ExecutorConfig), provided=("model", "kernel", "seed"),
        ),
    )


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


def build_executor(cfg: Any) -> Executor:
    """Check the whole config, then construct the executor (for a real model: load its weights)."""
    return check_config(cfg).executor.build(model=cfg.model, kernel=cfg.kernel, seed=cfg.seed)


def build_engine(cfg: Any, executor: Executor | None = None) -> Engine:
    """Check `cfg`, build the cheap parts, then the executor (unless one is given), then the cache."""
    plugins = check_config(cfg)
    policy = plugins.policy.build()
    preemption = plugins.preemption.build()
    reservation = plugins.reservation.build()
    if executor is None:
        executor = plugins.executor.build(model=cfg.model, kernel=cfg.kernel, seed=cfg.seed)
    else:
        executor.configure_kernel(cfg.kernel)
    block_size = cfg.allocator.block_size
    num_blocks = num_blocks_for(cfg, executor.kv_cache_spec(block_size).bytes_per_block)
    executor.init_kv_cache(num_blocks, block_size)
    allocator = plugins.allocator.build(num_blocks=num_blocks, block_size=block_size)
    block_manager = BlockManager(allocator, watermark=cfg.allocator.watermark, reservation=reservation)
    scheduler = Scheduler(
        cfg.scheduler, block_manager, policy, preemption=preemption, eos_token_ids=executor.eos_token_ids
    )
    log.info(
        "KV cache: %d blocks of %d tokens (%d tokens); allocator %s, policy %s, executor %s",
        num_blocks, block_size, num_blocks * block_size, plugins.allocator.path, plugins.policy.path,
        executor.description,
    )
    return Engine(executor, scheduler)
