"""`allocator.offload`: the config of the tiers for evicted prefix blocks, checked before any weights
load (`check_offload`) and built into the engine's `KVTiers` once the executor says what a block
costs (`build_kv_tiers`).

The CPU tier's blocks are host blocks of the executor's host pool after the swap pool's, so its
copies ride with the swaps; the disk tier's files are the executor's (`Executor.kv_tier_store`), in
a folder of this run's own under `disk_path`. Each tier's eviction policy is one of the device's
(`conf/allocator/eviction/<name>.yaml`), keyed by slot.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from paged.config import CONF_DIR, ConfigError, parse_bytes
from paged.config.plugins import Plugin, check_plugin
from paged.executor.base import Executor
from paged.memory.eviction.eviction_policy import EvictionPolicy
from paged.memory.kv_tiers import KVTiers
from paged.memory.prefix import PrefixCachingAllocator
from paged.memory.tier_pool import TierPool

log = logging.getLogger(__name__)

EVICTION_DIR = CONF_DIR / "allocator" / "eviction"


@dataclass(frozen=True)
class OffloadPlan:
    """`allocator.offload`, parsed and checked: bytes per tier and each tier's eviction policy."""

    cpu_bytes: int
    cpu_policy: Plugin
    disk_path: str | None = None
    disk_bytes: int = 0
    disk_policy: Plugin | None = None


def check_offload(cfg: Any, allocator_cls: type, executor_cls: type[Executor]) -> OffloadPlan | None:
    """`allocator.offload` checked against the allocator, the executor and the disk; None when off."""
    o = cfg.allocator.offload
    cpu_bytes = 0 if str(o.cpu_bytes).strip() == "0" else parse_bytes(o.cpu_bytes, key="allocator.offload.cpu_bytes")
    if not cpu_bytes:
        if o.disk_path is not None:
            raise ConfigError(f"allocator.offload.disk_path={o.disk_path!r} needs a CPU tier above it: set "
                              "allocator.offload.cpu_bytes (e.g. 512MiB)")
        return None
    if not issubclass(allocator_cls, PrefixCachingAllocator):
        what = "caches no prefixes" if not allocator_cls.caches_prefixes else "does not report its evictions"
        raise ConfigError(f"allocator.offload.cpu_bytes={o.cpu_bytes!r} keeps evicted prefix blocks, but allocator="
                          f"{cfg.allocator.name} {what}; use allocator=prefix")
    if not executor_cls.supports_kv_tiers:
        raise ConfigError(f"allocator.offload needs an executor that moves prefix tiers' blocks; "
                          f"{executor_cls.__qualname__} cannot; set allocator.offload.cpu_bytes=0")
    if cfg.executor.get("tensor_parallel_size", 1) != 1:
        raise ConfigError(f"allocator.offload is not supported with executor.tensor_parallel_size="
                          f"{cfg.executor.tensor_parallel_size}; use 1, or allocator.offload.cpu_bytes=0")
    if cfg.cluster.prefill_replicas or cfg.cluster.decode_replicas:
        raise ConfigError("allocator.offload is not supported with disaggregated prefill/decode "
                          "(cluster.prefill_replicas, cluster.decode_replicas); set allocator.offload.cpu_bytes=0")
    cpu_policy = _policy(o.cpu_eviction, "allocator.offload.cpu_eviction")
    if o.disk_path is None:
        if o.disk_bytes is not None:
            raise ConfigError(f"allocator.offload.disk_bytes={o.disk_bytes!r} needs allocator.offload.disk_path")
        return OffloadPlan(cpu_bytes, cpu_policy)
    if o.disk_bytes is None:
        raise ConfigError(f"allocator.offload.disk_path={o.disk_path!r} needs allocator.offload.disk_bytes "
                          "(e.g. 4GiB)")
    disk_bytes = parse_bytes(o.disk_bytes, key="allocator.offload.disk_bytes")
    _check_disk(o.disk_path, disk_bytes, o.disk_bytes)
    return OffloadPlan(cpu_bytes, cpu_policy, o.disk_path, disk_bytes,
                       _policy(o.disk_eviction, "allocator.offload.disk_eviction"))


def _policy(name: str, key: str) -> Plugin:
    """The eviction policy `conf/allocator/eviction/<name>.yaml` names, checked."""
    path = EVICTION_DIR / f"{name}.yaml"
    if not path.is_file():
        names = sorted(p.stem for p in EVICTION_DIR.glob("*.yaml"))
        raise ConfigError(f"{key}={name!r} is not an eviction policy; allowed: {', '.join(names)}")
    return check_plugin(OmegaConf.load(path), key, EvictionPolicy, core=("name",))


def _check_disk(disk_path: str, disk_bytes: int, text: str) -> None:
    """The disk tier's folder can be made and written, and its disk has `disk_bytes` free."""
    folder = Path(disk_path).expanduser()
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"allocator.offload.disk_path={disk_path!r} is not writable ({existing} is not a "
                          "writable folder); give a folder this process can write")
    free = shutil.disk_usage(existing).free
    if free < disk_bytes:
        raise ConfigError(f"allocator.offload.disk_bytes={text!r} ({disk_bytes} bytes) is more than the "
                          f"{free} bytes free on the disk of allocator.offload.disk_path={disk_path!r}")


def build_kv_tiers(cfg: Any, plan: OffloadPlan | None, executor: Executor, num_cpu_blocks: int) -> KVTiers | None:
    """The tiers below the device, their CPU slots the host blocks after the swap pool's
    `num_cpu_blocks`; None when offload is off. Call it after the executor's `init_kv_cache` with
    room for both (`num_tier_blocks`): the disk tier's store reads that host pool."""
    if plan is None:
        return None
    o = cfg.allocator.offload
    num_cpu, num_disk = num_tier_blocks(cfg, plan, executor)
    cpu = TierPool("cpu", num_cpu, plan.cpu_policy.build())
    log.info("allocator.offload: CPU tier of %d blocks (%s)", num_cpu, o.cpu_eviction)
    if plan.disk_path is None:
        return KVTiers(cpu, host_offset=num_cpu_blocks)
    folder = Path(plan.disk_path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    store = executor.kv_tier_store(str(folder))
    assert plan.disk_policy is not None
    disk = TierPool("disk", num_disk, plan.disk_policy.build())
    log.info("allocator.offload: disk tier of %d blocks under %s (%s)", num_disk, folder, o.disk_eviction)
    return KVTiers(cpu, num_cpu_blocks, disk, store)


def num_tier_blocks(cfg: Any, plan: OffloadPlan | None, executor: Executor) -> tuple[int, int]:
    """Blocks of the CPU tier (host blocks the executor's pool adds) and of the disk tier; each
    tier's bytes must hold one block, and the CPU tier's fit in this machine's memory."""
    if plan is None:
        return 0, 0
    o = cfg.allocator.offload
    bytes_per_block = executor.kv_cache_spec(cfg.allocator.block_size).bytes_per_block
    sizes = [("cpu_bytes", o.cpu_bytes, plan.cpu_bytes)]
    if plan.disk_path is not None:
        sizes.append(("disk_bytes", o.disk_bytes, plan.disk_bytes))
    for key, text, num_bytes in sizes:
        if num_bytes < bytes_per_block:
            raise ConfigError(f"allocator.offload.{key}={text!r} is smaller than one KV block ({bytes_per_block} "
                              f"bytes at allocator.block_size={cfg.allocator.block_size}); give it at least that")
    host = executor.host_memory_bytes()
    if host is not None and plan.cpu_bytes > host:
        raise ConfigError(f"allocator.offload.cpu_bytes={o.cpu_bytes!r} is more than this machine's {host} bytes "
                          "of memory")
    return plan.cpu_bytes // bytes_per_block, plan.disk_bytes // bytes_per_block
