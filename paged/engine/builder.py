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

import torch

from paged.config import AllocatorConfig, ByteSizes, ConfigError, ExecutorConfig, validate
from paged.config.plugins import Plugin, check_plugin
from paged.engine.engine import Engine
from paged.engine.fast_forward import FastForward
from paged.engine.offload import OffloadPlan, build_kv_tiers, check_offload, num_tier_blocks
from paged.engine.press_checks import check_press
from paged.executor.base import Executor
from paged.kv_layout import KVLayout
from paged.memory import BlockAllocator, BlockManager, ExactReservation, Reservation
from paged.memory.compaction import CompactingBlockManager
from paged.memory.eviction import POLICIES, EvictionPolicy, LRUPolicy
from paged.memory.group_compaction import CompactingGroupManager
from paged.memory.kv_groups import KVGroupManager
from paged.model.spec import model_spec
from paged.scheduler.core import Scheduler
from paged.scheduler.policy import SchedulingPolicy
from paged.scheduler.preemption import MODES, PreemptionMode
from paged.sim.calibrate import calibrated_hardware
from paged.sim.executor import SimExecutor
from paged.workload import check_inputs

log = logging.getLogger(__name__)

# KV blocks when the config gives no size and the executor has no device memory to share it from
# (the real model on a CPU, whose cache takes host memory): 32k tokens at the default block size
DEFAULT_NUM_BLOCKS = 2048


def _core_keys(schema: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(schema))


@dataclass(frozen=True)
class Plugins:
    """The checked pluggable parts of one config, and its parsed byte sizes."""

    sizes: ByteSizes
    allocator: Plugin
    reservation: Plugin
    policy: Plugin
    preemption: Plugin
    executor: Plugin
    offload: OffloadPlan | None = None  # allocator.offload's tiers (None: off)
    eviction: Plugin | None = None  # the prefix cache's eviction policy (None: the allocator caches no prefixes)
    async_scheduling: bool = False  # scheduler.async_scheduling resolved (`resolve_async_scheduling`)
    press: Plugin | None = None  # kv_press (None: kv_press=none, no compression)


def check_config(cfg: Any, executor_cls: type[Executor] | None = None) -> Plugins:
    """Every key known, range checks on the core keys, the workload's inputs (sampling keys, files),
    then every plugin's class and settings; builds nothing and loads no weights.
    `executor_cls` is the class of an executor the caller already has (else the configured one)."""
    executor = check_plugin(
        cfg.executor, "executor", Executor, core=_core_keys(ExecutorConfig), provided=("model", "kernel", "seed"),
    )
    runs_on = executor_cls or executor.cls
    if cfg.executor.fast_forward and not issubclass(runs_on, SimExecutor):
        raise ConfigError(
            f"executor.fast_forward=true advances a simulated clock; executor={cfg.executor.name} runs every step: "
            "use executor=sim, or executor.fast_forward=false"
        )
    sizes = validate(cfg, block_sizes=runs_on.block_sizes)
    check_inputs(cfg.workload, has_tokenizer=cfg.model.source != "spec", model_name=cfg.model.name)
    if cfg.model.device == "cuda" and not issubclass(runs_on, SimExecutor) and not torch.cuda.is_available():
        # else torch's own AssertionError ("Torch not compiled with CUDA enabled") after loading
        raise ConfigError(
            f"model.device=cuda but this torch {torch.__version__} sees no CUDA device; use model.device=auto "
            "(CUDA where there is one, else the CPU) or model.device=cpu"
        )
    plugins = Plugins(
        sizes=sizes,
        allocator=check_plugin(
            cfg.allocator, "allocator", BlockAllocator,
            core=_core_keys(AllocatorConfig), provided=("num_blocks", "block_size"),
        ),
        reservation=check_plugin(cfg.allocator.reservation, "allocator.reservation", Reservation),
        policy=check_plugin(cfg.scheduler.policy, "scheduler.policy", SchedulingPolicy),
        preemption=_check_preemption(cfg.scheduler),
        executor=executor,
    )
    if cfg.model.source == "spec" and not plugins.executor.cls.runs_spec_models:
        raise ConfigError(
            f"model={cfg.model.name} is a spec-only model (no weights): executor={cfg.executor.name} cannot "
            "run it; use executor=sim"
        )
    _check_swap(cfg, plugins, runs_on)
    plugins = dataclasses.replace(plugins, eviction=_check_eviction(cfg, plugins.allocator))
    plugins = dataclasses.replace(plugins, offload=check_offload(cfg, plugins.allocator.cls, runs_on))
    _precheck_kv_groups(cfg, plugins)
    press = check_press(cfg, runs_on, swaps=plugins.preemption.cls.swaps, offload=plugins.offload is not None,
                        paged_exact=not plugins.allocator.cls.contiguous
                        and plugins.reservation.cls is ExactReservation)
    plugins = dataclasses.replace(plugins, press=press)
    plugins = dataclasses.replace(plugins, async_scheduling=resolve_async_scheduling(cfg, plugins.executor, runs_on))
    if plugins.reservation.cls.needs_output_lengths and not cfg.workload.ignore_eos:
        raise ConfigError(
            f"allocator={cfg.allocator.name} reserves each request's true output length, which the workload "
            "only knows when EOS cannot end a request early: set workload.ignore_eos=true, or use "
            "allocator=orca-pow2 / orca-max"
        )
    return plugins


def resolve_async_scheduling(cfg: Any, executor: Plugin, runs_on: type[Executor]) -> bool:
    """`scheduler.async_scheduling`: null is on for an executor that can run it on a CUDA model and
    off elsewhere; true where it cannot run is an error naming why (`async_scheduling_refusal`, or a
    workload whose sequence groups need each step's tokens before the next step is scheduled)."""
    asked = cfg.scheduler.async_scheduling
    refusal = runs_on.async_scheduling_refusal(executor.settings)
    if refusal is None and cfg.kv_press.get("_target_") is not None:
        refusal = (f"does not run with kv_press={cfg.kv_press.name}: a compression changes a sequence's block "
                   "table after the step that the next one would be launched before")
    w = cfg.workload
    forks = {"n": w.n > 1, "best_of": (w.best_of or 1) > 1, "use_beam_search": w.use_beam_search}
    forking = {key: getattr(w, key) for key, forks_ in forks.items() if forks_}
    if refusal is None and forking:
        keys = ", ".join(f"workload.{key}={value}" for key, value in forking.items())
        refusal = (f"does not run with {keys}: a request's samples or beams fork and are pruned by the tokens each "
                   "step samples, which the next step's schedule needs")
    if asked is None:
        device = cfg.model.device
        return refusal is None and (device == "cuda" or (device == "auto" and torch.cuda.is_available()))
    if asked and refusal is not None:
        raise ConfigError(f"scheduler.async_scheduling=true {refusal}; use scheduler.async_scheduling=false or null")
    return bool(asked)


def _check_preemption(s: Any) -> Plugin:
    """The built-in mode `scheduler.preemption_mode` names, or a custom `scheduler.preemption._target_`."""
    if s.preemption.get("_target_") is None:
        return Plugin("scheduler.preemption", MODES[s.preemption_mode], {})
    if s.preemption_mode != "recompute":
        raise ConfigError(
            f"scheduler.preemption_mode={s.preemption_mode!r} and scheduler.preemption._target_="
            f"{s.preemption._target_!r} both choose the preemption mode; set one of them"
        )
    return check_plugin(s.preemption, "scheduler.preemption", PreemptionMode)


def _check_eviction(cfg: Any, allocator: Plugin) -> Plugin | None:
    """`allocator.eviction`, for an allocator with a prefix cache; one without may only leave it at
    the default (LRU), as every allocator YAML inherits `allocator/eviction: lru`."""
    builtin = f"the built-in policies: allocator/eviction={'|'.join(POLICIES)}"
    try:
        eviction = check_plugin(cfg.allocator.eviction, "allocator.eviction", EvictionPolicy)
    except ConfigError as e:
        if "_target_" not in str(e):
            raise
        raise ConfigError(f"{e}; {builtin}") from None
    if allocator.cls.caches_prefixes:
        return eviction
    if eviction.cls is not LRUPolicy or eviction.settings:
        name = getattr(eviction.cls, "name", eviction.path)
        raise ConfigError(
            f"allocator/eviction={name} chooses what a prefix cache evicts, but allocator={cfg.allocator.name} "
            "caches no prefixes; use allocator=prefix, or leave allocator/eviction at lru"
        )
    return None


def _check_swap(cfg: Any, plugins: Plugins, executor_cls: type[Executor]) -> None:
    if not plugins.preemption.cls.swaps:
        return
    mode = f"scheduler.preemption_mode={cfg.scheduler.preemption_mode}"
    if not plugins.allocator.cls.supports_swap:
        raise ConfigError(
            f"{mode} needs an allocator that can swap; allocator._target_={plugins.allocator.path} cannot "
            "(it does not set supports_swap); use scheduler.preemption_mode=recompute"
        )
    if not executor_cls.supports_swap:
        raise ConfigError(
            f"{mode} needs an executor that moves swapped blocks; {executor_cls.__qualname__} cannot; "
            "use scheduler.preemption_mode=recompute"
        )


def num_cpu_blocks_for(cfg: Any, sizes: ByteSizes, executor: Executor, preemption: PreemptionMode) -> int:
    """Blocks of the CPU swap pool: `allocator.swap_space` per device over the bytes of one block;
    none unless the preemption mode swaps."""
    if not preemption.swaps:
        return 0
    a = cfg.allocator
    swap_space = sizes.swap_space * executor.num_devices
    bytes_per_block = executor.kv_cache_spec(a.block_size).bytes_per_block
    if swap_space < bytes_per_block:
        raise ConfigError(
            f"allocator.swap_space={a.swap_space!r} is smaller than one KV block ({bytes_per_block} bytes at "
            f"allocator.block_size={a.block_size}); give it at least that"
        )
    host = executor.host_memory_bytes()
    if host is not None and swap_space > host:
        raise ConfigError(
            f"allocator.swap_space={a.swap_space!r} ({swap_space} bytes for {executor.num_devices} device(s)) "
            f"is more than this machine's {host} bytes of memory"
        )
    return swap_space // bytes_per_block


def num_blocks_for(cfg: Any, sizes: ByteSizes, executor: Executor) -> int:
    """The first rule that applies: `allocator.num_blocks`; the byte budget `allocator.kv_cache_memory`
    over the bytes of one block; the executor's share of device memory
    (`allocator.gpu_memory_utilization`, `Executor.kv_cache_budget`) over them; `DEFAULT_NUM_BLOCKS`
    where the executor has no device memory to share (the real model on a CPU)."""
    a = cfg.allocator
    if a.num_blocks is not None:
        log.info("KV cache sized by allocator.num_blocks=%d", a.num_blocks)
        return int(a.num_blocks)
    bytes_per_block = executor.kv_cache_spec(a.block_size).bytes_per_block
    if sizes.kv_cache_memory is not None:
        budget, source = sizes.kv_cache_memory, f"allocator.kv_cache_memory={a.kv_cache_memory!r}"
    else:
        s = cfg.scheduler
        budget = executor.kv_cache_budget(a.gpu_memory_utilization, s.max_num_batched_tokens, s.max_num_seqs)
        if budget is None:
            log.info(
                "KV cache sized by the default of %d blocks: %s has no device memory to share (set "
                "allocator.num_blocks or allocator.kv_cache_memory to size it)", DEFAULT_NUM_BLOCKS,
                type(executor).__qualname__,
            )
            return DEFAULT_NUM_BLOCKS
        source = f"allocator.gpu_memory_utilization={a.gpu_memory_utilization}"
    num_blocks = budget // bytes_per_block
    if num_blocks <= 0:
        raise ConfigError(f"{source} leaves room for no block (one block takes {bytes_per_block} bytes)")
    log.info("KV cache sized by %s: %d bytes, %d blocks of %d bytes", source, budget, num_blocks, bytes_per_block)
    return num_blocks


def kv_layout_for(cfg: Any, plugins: Plugins, executor: Executor) -> KVLayout:
    """How the model's layers share block tables (`allocator.kv_groups`); an executor that gives no
    per-layer windows is one group with its `sliding_window`."""
    layout = KVLayout.build(executor.layer_windows or (executor.sliding_window,), cfg.allocator.kv_groups)
    _check_kv_layout(cfg, plugins, layout)
    return layout


def _precheck_kv_groups(cfg: Any, plugins: Plugins) -> None:
    """`_check_kv_layout` before any weights load, from the model's metadata (its config.json, GGUF
    header or spec), only when the config asks for something several groups cannot do."""
    if cfg.allocator.kv_groups == "single" or not (
        plugins.preemption.cls.swaps or plugins.allocator.cls.contiguous or plugins.offload is not None
    ):
        return
    _check_kv_layout(cfg, plugins, KVLayout.build(model_spec(cfg.model)[0].layer_windows, cfg.allocator.kv_groups))


def _check_kv_layout(cfg: Any, plugins: Plugins, layout: KVLayout) -> None:
    """Several groups cannot swap, use an allocator of contiguous extents or keep prefix tiers."""
    if not layout.is_hybrid:
        return
    groups = f"allocator.kv_groups={cfg.allocator.kv_groups} gives this model {layout.num_groups} KV groups"
    if plugins.offload is not None:
        raise ConfigError(
            f"allocator.offload is not supported with several KV groups: {groups}; use allocator.kv_groups=single "
            "or allocator.offload.cpu_bytes=0"
        )
    if plugins.preemption.cls.swaps:
        raise ConfigError(
            f"scheduler.preemption_mode={cfg.scheduler.preemption_mode} cannot swap: {groups}; use "
            "scheduler.preemption_mode=recompute or allocator.kv_groups=single"
        )
    if plugins.allocator.cls.contiguous:
        raise ConfigError(
            f"allocator={cfg.allocator.name} hands out contiguous extents: {groups}, which need a paged "
            "allocator (naive, prefix); or use allocator.kv_groups=single"
        )


def _measured_hardware(cfg: Any, plugins: Plugins) -> dict[str, Any]:
    """A simulator of this machine (`hardware.calibrated`: cpu-local) gets its hardware with the
    nulls measured by driving a real engine built from the same config; the builder builds that
    engine, as sim/ sits below it. Nothing for any other executor."""
    hardware = plugins.executor.settings.get("hardware")
    if not issubclass(plugins.executor.cls, SimExecutor) or not hardware or not hardware.get("calibrated"):
        return {}
    return {"hardware": calibrated_hardware(cfg, hardware, build_engine)}


def _build_executor(cfg: Any, plugins: Plugins) -> Executor:
    return plugins.executor.build(model=cfg.model, kernel=cfg.kernel, seed=cfg.seed, **_measured_hardware(cfg, plugins))


def build_executor(cfg: Any) -> Executor:
    """Check the whole config, then construct the executor (for a real model: load its weights)."""
    return _build_executor(cfg, check_config(cfg))


def build_engine(cfg: Any, executor: Executor | None = None) -> Engine:
    """Check `cfg`, build the cheap parts, then the executor (unless one is given), then the cache."""
    plugins = check_config(cfg, type(executor) if executor is not None else None)
    policy = plugins.policy.build()
    preemption = plugins.preemption.build()
    reservation = plugins.reservation.build()
    eviction = {"eviction": plugins.eviction.build()} if plugins.eviction is not None else {}
    if executor is None:
        executor = _build_executor(cfg, plugins)
    else:
        executor.configure_kernel(cfg.kernel)
    block_size = cfg.allocator.block_size
    layout = kv_layout_for(cfg, plugins, executor)
    # before the cache is sized: a block then holds `layout.num_slots` layers
    executor.set_kv_layout(layout)
    num_blocks = num_blocks_for(cfg, plugins.sizes, executor)
    num_cpu_blocks = num_cpu_blocks_for(cfg, plugins.sizes, executor, preemption)
    executor.set_batch_limits(cfg.scheduler.max_num_seqs, cfg.scheduler.max_model_len,
                              cfg.scheduler.max_num_batched_tokens)
    executor.set_async_scheduling(plugins.async_scheduling)
    # the host pool holds the swap pool's blocks, then the CPU tier's (allocator.offload)
    executor.init_kv_cache(num_blocks, block_size, num_cpu_blocks + num_tier_blocks(cfg, plugins.offload, executor)[0])
    tiers = build_kv_tiers(cfg, plugins.offload, executor, num_cpu_blocks)
    allocator = plugins.allocator.build(num_blocks=num_blocks, block_size=block_size, **eviction)
    block_manager: BlockManager | KVGroupManager
    press = plugins.press.build() if plugins.press is not None else None
    if press is not None and not layout.is_hybrid:
        block_manager = CompactingBlockManager(
            allocator, watermark=cfg.allocator.watermark, reservation=reservation,
            max_model_len=cfg.scheduler.max_model_len, share_blocks=cfg.allocator.share_blocks,
        )
    elif layout.is_hybrid:
        block_manager = (KVGroupManager if press is None else CompactingGroupManager)(
            allocator, layout, watermark=cfg.allocator.watermark, reservation=reservation,
            max_model_len=cfg.scheduler.max_model_len, share_blocks=cfg.allocator.share_blocks,
        )
    else:
        block_manager = BlockManager(
            allocator, watermark=cfg.allocator.watermark, reservation=reservation,
            max_model_len=cfg.scheduler.max_model_len, num_cpu_blocks=num_cpu_blocks,
            sliding_window=layout.groups[0].window, share_blocks=cfg.allocator.share_blocks, tiers=tiers,
        )
    scheduler = Scheduler(
        cfg.scheduler, block_manager, policy, preemption=preemption, eos_token_ids=executor.eos_token_ids,
        tokenizer=executor.tokenizer, vocab_size=executor.vocab_size, press=press,
    )
    log.info(
        "KV cache: %d blocks of %d tokens (%d tokens), %d CPU swap blocks; allocator %s, policy %s, executor %s",
        num_blocks, block_size, num_blocks * block_size, num_cpu_blocks, plugins.allocator.path, plugins.policy.path,
        executor.description,
    )
    engine = Engine(executor, scheduler, async_scheduling=plugins.async_scheduling)
    if cfg.executor.fast_forward and press is None:  # a press changes held lengths mid-window: stepped
        engine.fast_forward = FastForward()
    return engine
