"""Turn a composed config into a fleet: the router, then the replicas where `cluster.backend` puts
them. Everything is checked (the router's class and settings, the engine config, the backend)
before a replica loads weights."""

from __future__ import annotations

import logging
from typing import Any

from paged.cluster.disaggregated import build_disaggregated_fleet, check_disaggregation
from paged.cluster.fleet import Fleet
from paged.cluster.replica import LocalReplica
from paged.cluster.router import Router
from paged.config import ConfigError, RouterConfig
from paged.config.plugins import Plugin, check_plugin
from paged.engine.builder import build_engine, check_config
from paged.engine.metrics import MetricsRecorder
from paged.sim.executor import SimExecutor

log = logging.getLogger(__name__)


def uses_fleet(cfg: Any) -> bool:
    """Whether `cfg` asks for more than one engine (replicas, or disaggregated pools)."""
    c = cfg.cluster
    return c.num_replicas > 1 or c.prefill_replicas > 0


def fleet_backend(cfg: Any, plugins_executor: type) -> str:
    """`cluster.backend` resolved: `auto` is Ray for a real model and this process for the simulator."""
    backend = cfg.cluster.backend
    if backend != "auto":
        return backend
    return "local" if issubclass(plugins_executor, SimExecutor) else "ray"


def check_fleet(cfg: Any) -> tuple[Plugin, str]:
    """The engine config (`paged.engine.builder.check_config`), the router plugin and the backend; loads nothing."""
    plugins = check_config(cfg)
    router = check_plugin(cfg.router, "router", Router, core=tuple(RouterConfig.__dataclass_fields__))
    backend = fleet_backend(cfg, plugins.executor.cls)
    c = cfg.cluster
    if c.prefill_replicas > 0:
        if not issubclass(plugins.executor.cls, SimExecutor) or backend != "local":
            raise ConfigError(
                f"cluster.prefill_replicas={c.prefill_replicas}: disaggregated prefill/decode is simulated only; "
                f"use executor=sim and cluster.backend=local or auto (got {cfg.executor.name}, {c.backend})"
            )
        check_disaggregation(cfg)
    elif backend == "ray" and issubclass(plugins.executor.cls, SimExecutor):
        raise ConfigError(
            "cluster.backend=ray runs real engines, each on its own wall clock; executor=sim's replicas share "
            "one virtual clock in this process: use cluster.backend=local or auto"
        )
    elif backend == "local" and not issubclass(plugins.executor.cls, SimExecutor):
        log.warning("cluster.backend=local: %d real replicas take turns in this process (no parallelism)",
                    c.num_replicas)
    return router, backend


def build_fleet(cfg: Any) -> Fleet:
    """The router and `cluster.num_replicas` engines built from `cfg`, in this process or on Ray."""
    router_plugin, backend = check_fleet(cfg)
    if cfg.cluster.prefill_replicas > 0:
        return build_disaggregated_fleet(cfg, router_plugin)
    router = router_plugin.build()
    if backend == "ray":
        from paged.cluster.ray_fleet import build_ray_fleet

        return build_ray_fleet(cfg, router)
    metrics = MetricsRecorder()
    replicas = []
    for i in range(cfg.cluster.num_replicas):
        engine = build_engine(cfg)
        engine.metrics = metrics
        replicas.append(LocalReplica(i, engine))
    log.info("fleet: %d replicas in this process, router %s", len(replicas), cfg.router.name)
    return Fleet(replicas, router, metrics)
