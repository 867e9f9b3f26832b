"""What `kv_press` cannot run with, refused before any weights load, one line naming the key: the
press's own budget and settings, an executor that cannot compact (or give the norms and scores it
reads), swap, contiguous extents, reservations, prefix tiers, tensor-parallel scores, ALiBi, and a
model whose layers have a sliding window unless they get KV groups of their own (then the press
compresses the full-attention groups and leaves the windowed ones to their window)."""

from __future__ import annotations

from typing import Any

from paged.config import ConfigError
from paged.config.plugins import Plugin, check_plugin
from paged.executor.base import Executor
from paged.kv_layout import KVLayout
from paged.memory.press import PRESSES, KVPress
from paged.model.spec import model_spec
from paged.sim.executor import SimExecutor


def check_press(cfg: Any, runs_on: type[Executor], *, swaps: bool, paged_exact: bool, offload: bool) -> Plugin | None:
    """`kv_press`, built once here so that a bad budget fails before any weights load; None for
    kv_press=none. `swaps`: the preemption mode swaps; `paged_exact`: the allocator hands out paged
    blocks with exact reservations; `offload`: allocator.offload keeps prefix tiers."""
    if cfg.kv_press.get("_target_") is None:
        return None
    builtin = f"the built-in presses: kv_press=none|{'|'.join(PRESSES)}"
    try:
        press = check_plugin(cfg.kv_press, "kv_press", KVPress, core=("name",))
    except ConfigError as e:
        raise ConfigError(f"{e}; {builtin}") from None
    press.build().check_context(cfg.scheduler.max_model_len)
    what = f"kv_press={cfg.kv_press.name}"
    if not runs_on.supports_kv_press:
        raise ConfigError(f"{what} needs an executor that compacts KV blocks; executor={cfg.executor.name} "
                          f"({runs_on.__qualname__}) cannot; use executor=model or kv_press=none")
    if issubclass(runs_on, SimExecutor) and (press.cls.needs_norms or press.cls.needs_scores):
        raise ConfigError(f"{what} reads the cache's K/V, which executor=sim does not hold: use kv_press=sink-window "
                          "there, or executor=model")
    if swaps:
        raise ConfigError(f"{what} does not swap compressed sequences: use scheduler.preemption_mode=recompute")
    if not paged_exact:
        raise ConfigError(f"{what} needs a paged allocator with exact reservations (allocator=naive or prefix), "
                          f"not allocator={cfg.allocator.name}")
    if offload:
        raise ConfigError(f"{what} does not run with allocator.offload: use allocator.offload.cpu_bytes=0")
    if press.cls.needs_scores and (cfg.executor.get("tensor_parallel_size") or 1) > 1:
        raise ConfigError(f"{what} reads attention mass, which one rank's heads do not give: use "
                          "executor.tensor_parallel_size=1 or a press without scores (sink-window, knorm, block-norm)")
    spec = model_spec(cfg.model)[0]
    _check_windows(cfg, what, spec.layer_windows)
    if spec.positions != "rope":
        raise ConfigError(f"{what} needs a RoPE model: model={cfg.model.name}'s {spec.positions} positions "
                          "would be read from KV indices, which compression shifts")
    return press


def _check_windows(cfg: Any, what: str, layer_windows: tuple[int | None, ...]) -> None:
    """A press compresses full-attention layers only, each KV group of them with its own keep set: the
    kernels count a window in KV indices, which a compression shifts, so windowed layers need their
    own groups (allocator.kv_groups=auto), and a model of windowed layers only has nothing to press."""
    if cfg.model.sliding_window is not None or all(w is not None for w in layer_windows):
        raise ConfigError(f"{what} has nothing to compress on model={cfg.model.name}, whose every layer has a sliding "
                          "window (a windowed layer's blocks are freed by its window already); use kv_press=none")
    if all(w is None for w in layer_windows):
        return
    layout = KVLayout.build(layer_windows, cfg.allocator.kv_groups)
    if not layout.is_hybrid:
        raise ConfigError(f"{what} needs allocator.kv_groups=auto on model={cfg.model.name}, whose sliding-window "
                          "layers would otherwise share the full-attention layers' compressed tables")
