"""The engine inside a Ray replica: the actor class that `paged.cluster.ray_fleet` starts per replica.

It runs in a Ray worker process, maybe on another machine. It gets the driver's composed config as a
plain container and builds a full engine from it with `paged.engine.builder.build_engine`, as run.py would;
it composes nothing and routes nothing. Its clock reads the driver's time: the driver sends the
moment it reset its clock (wall-clock seconds since the epoch, comparable across machines), so the
step and request times the actor records are on the driver's origin.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import ray
from omegaconf import OmegaConf

from paged.cluster.replica_messages import Outcome, ReplicaInfo, StepReport, Submission
from paged.config import PLUGIN_NODES, Config
from paged.engine.builder import build_engine
from paged.request import Request
from paged.utils.clock import Clock


class EpochClock(Clock):
    """The wall clock from an origin given as epoch seconds (`time.time()`), another process's;
    it runs on `time.perf_counter` between resets, so it never steps back."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def reset(self) -> None:
        self.reset_to(time.time())

    def reset_to(self, origin: float) -> None:
        self._t0 = time.perf_counter() - (time.time() - origin)

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))


def typed_config(container: dict[str, Any]) -> Any:
    """The config the driver composed, from its plain container: merged into the schema (open at the
    plugin nodes, as Hydra composes it), so that config sections reach the plugins as their dataclasses."""
    schema = OmegaConf.structured(Config)
    for key in PLUGIN_NODES:
        OmegaConf.set_struct(OmegaConf.select(schema, key), False)
    return OmegaConf.merge(schema, container)


class EngineActor:
    """One replica's engine. The driver calls `build` first, then submits, steps and aborts; a Ray
    actor runs its calls one at a time, in the order one caller made them."""

    def build(self, config: dict[str, Any]) -> ReplicaInfo:
        """Load the model and size the cache (in `build`, not `__init__`, so that a failure reaches the
        driver as the error it is rather than as a dead actor)."""
        self.engine = build_engine(typed_config(config))
        self.clock = EpochClock()
        self.engine.clock = self.clock  # the engine reads its time here only
        self._keys: dict[Request, int] = {}
        self._steps_sent = 0
        executor = self.engine.executor
        block_size = self.engine.block_size
        return ReplicaInfo(
            description=executor.description,
            kernel_description=executor.kernel_description,
            threads=executor.threads,
            num_devices=executor.num_devices,
            kv_cache_spec=executor.kv_cache_spec(block_size),
            kv_layout=executor.kv_layout,
            tokenizer=executor.tokenizer,
            vocab_size=executor.vocab_size,
            eos_token_ids=frozenset(executor.eos_token_ids),
            plugin_classes=self.engine.plugin_classes(),
            caches_prefixes=self.engine.caches_prefixes,
            node=ray.util.get_node_ip_address(),
            state=self._report([]),
        )

    def reset_clock(self, origin: float) -> None:
        self.clock.reset_to(origin)

    def add_request(self, submission: Submission) -> None:
        request = submission.request()
        self._keys[request] = submission.key
        self.engine.add_request(request)

    def step(self) -> StepReport:
        return self._report(self.engine.step())

    def abort_all(self, reason: str) -> StepReport:
        return self._report(self.engine.abort_all(reason))

    def _report(self, done: list[Request]) -> StepReport:
        metrics = self.engine.metrics
        steps = metrics.steps[self._steps_sent:]
        self._steps_sent = len(metrics.steps)
        return StepReport(
            outcomes=[Outcome.of(self._keys.pop(r), r) for r in done],
            steps=steps,
            num_waiting=len(self.engine.scheduler.waiting),
            num_running_requests=self.engine.request_counts()[0],
            kv_usage=self.engine.kv_usage(),
            kv=self.engine.kv_stats(),
            counters=copy.copy(self.engine.counters),
            num_swap_fallbacks=self.engine.num_swap_fallbacks,
            decode_step_counts=self.engine.executor.decode_step_counts(),
            client_service=dict(metrics.client_service),
        )
