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

from paged.cluster.replica_messages import Outcome, Progress, ReplicaInfo, StepReport, Submission
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
    """One replica's engine. The driver calls `build` first, then submits, steps and aborts (one
    request, or all); a Ray actor runs its calls one at a time, in the order one caller made them."""

    def build(self, config: dict[str, Any]) -> ReplicaInfo:
        """Load the model and size the cache (in `build`, not `__init__`, so that a failure reaches the
        driver as the error it is rather than as a dead actor)."""
        self.engine = build_engine(typed_config(config))
        self.clock = EpochClock()
        self.engine.clock = self.clock  # the engine reads its time here only
        self._keys: dict[Request, int] = {}
        self._by_key: dict[int, Request] = {}  # the requests not yet reported ended, by the driver's key
        self._sent: dict[int, int] = {}  # key -> output tokens of the request reported so far (`Progress`)
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
        self._by_key[submission.key] = request
        self.engine.add_request(request)

    def step(self) -> StepReport:
        return self._report(self.engine.step())

    def abort(self, key: int, reason: str) -> None:
        """Abort the request the driver sent under `key` (`Engine.abort`: its blocks are freed now, the
        next step reports it). A key already reported ended is ignored: the driver may have sent the
        abort while the step that ended the request was in flight."""
        request = self._by_key.get(key)
        if request is not None and request.abort_reason is None:
            self.engine.abort(request, reason)

    def abort_all(self, reason: str) -> StepReport:
        return self._report(self.engine.abort_all(reason))

    def _outcome(self, request: Request) -> Outcome:
        key = self._keys.pop(request)
        del self._by_key[key]
        self._sent.pop(key, None)
        return Outcome.of(key, request)

    def _progress(self) -> list[Progress]:
        """The new tokens of every single-sequence request still running (a beam's or a best-of's
        sequences fork and end; their output comes with the outcome)."""
        progress = []
        for key, request in self._by_key.items():
            if request.params.best_of != 1 or request.params.use_beam_search:
                continue
            seq = request.seqs[0]
            sent = self._sent.get(key, 0)
            new = seq.token_ids[seq.num_prompt_tokens + sent:]
            while new and new[-1] < 0:  # async scheduling's placeholders: tokens not read back yet
                new.pop()
            if new:
                self._sent[key] = sent + len(new)
                logprobs = None if seq.logprobs is None else seq.logprobs[sent:sent + len(new)]
                progress.append(Progress(key, list(new), logprobs))
        return progress

    def _report(self, done: list[Request]) -> StepReport:
        metrics = self.engine.metrics
        steps = metrics.steps[self._steps_sent:]
        self._steps_sent = len(metrics.steps)
        return StepReport(
            outcomes=[self._outcome(r) for r in done],
            progress=self._progress(),
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
