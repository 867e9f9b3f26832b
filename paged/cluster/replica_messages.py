"""What the driver and a Ray replica's actor send each other: plain, picklable records.

A `Request` is not sent as it is: its sequences carry ids from this process's counter, which would
collide with the ids the actor's own forks draw. The actor gets a `Submission` (the request's inputs)
and builds its own `Request`; what comes back for a request that ended is an `Outcome` (its outputs
and timestamps), which the driver applies to the `Request` it holds, the one the runner, the metrics
and the outputs read. A step comes back as a `StepReport`: the requests it ended, the others' new
tokens (`Progress`), its new step records and the replica's state after it (what the router and the
summary ask of the replica).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

from paged.engine.metrics import StepRecord
from paged.executor.base import KVCacheSpec, Tokenizer
from paged.kv_layout import KVLayout
from paged.request import Completion, Request, SamplingParams
from paged.scheduler.core import SchedulerCounters
from paged.step import KVStats
from paged.utils.threads import ThreadChoice


@dataclass(frozen=True)
class Submission:
    """A request's inputs, keyed by the driver (`key`: unique per replica)."""

    key: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prompt: str | None
    priority: int
    cache_salt: str | None
    client_id: str | None
    abort_reason: str | None  # set: the engine's intake aborts it (a prompt-file line that failed to load)

    @classmethod
    def of(cls, key: int, request: Request) -> Submission:
        return cls(
            key, request.request_id, request.prompt_token_ids, request.params, request.arrival_time,
            request.prompt, request.priority, request.cache_salt, request.client_id, request.abort_reason,
        )

    def request(self) -> Request:
        """A fresh `Request` in this process, as the driver's was before it was submitted."""
        request = Request(
            self.request_id, self.prompt_token_ids, self.params, arrival_time=self.arrival_time, prompt=self.prompt,
            priority=self.priority, cache_salt=self.cache_salt, client_id=self.client_id,
        )
        request.abort_reason = self.abort_reason
        return request


@dataclass(frozen=True)
class Outcome:
    """How a request ended on a replica: every field the metrics and the outputs read."""

    key: int
    params: SamplingParams  # the engine resolves `max_tokens=None` into the request's own params
    completions: list[Completion]
    first_token_time: float | None
    token_times: array
    finish_time: float | None
    abort_reason: str | None
    num_preemptions: int
    first_scheduled_time: float | None
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None

    @classmethod
    def of(cls, key: int, request: Request) -> Outcome:
        return cls(
            key, request.params, request.outputs(), request.first_token_time, request.token_times,
            request.finish_time, request.abort_reason, request.num_preemptions, request.first_scheduled_time,
            request.prompt_logprobs,
        )

    def apply(self, request: Request) -> None:
        """Make the driver's `request` read as the replica's did when it ended."""
        request.params = self.params
        request.completions = list(self.completions)
        request.first_token_time = self.first_token_time
        request.token_times = self.token_times
        request.finish_time = self.finish_time
        request.abort_reason = self.abort_reason
        request.num_preemptions = self.num_preemptions
        request.first_scheduled_time = self.first_scheduled_time
        request.prompt_logprobs = self.prompt_logprobs


@dataclass(frozen=True)
class Progress:
    """A running request's new output since the last report, so that the driver's copy grows as the
    replica's does (a server streams it): the new tokens of its one sequence and their logprobs when
    it asks for them. Sent for single-sequence requests only, whose tokens only grow; the others'
    output arrives with their `Outcome`."""

    key: int
    token_ids: list[int]
    logprobs: list[dict[int, tuple[float, int]]] | None

    def apply(self, request: Request) -> None:
        seq = request.seqs[0]
        seq.token_ids.extend(self.token_ids)
        if self.logprobs is not None and seq.logprobs is not None:
            seq.logprobs.extend(self.logprobs)


@dataclass(frozen=True)
class StepReport:
    """One step of a replica (or its abort of everything): what ended, the step records it added, and
    its state after it. `kv_usage` is the allocator's allocated share, as `LocalReplica.load` reads it."""

    outcomes: list[Outcome]
    steps: list[StepRecord]
    num_waiting: int
    num_running_requests: int  # `Engine.request_counts`' running
    kv_usage: float
    kv: KVStats
    counters: SchedulerCounters
    num_swap_fallbacks: int
    decode_step_counts: dict[str, int | None]
    client_service: dict[str, float]  # the replica's own VTC service per client, cumulative
    progress: list[Progress]  # the running requests' new tokens


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica's engine is, asked once when it is built: the executor's description for the
    summary, its tokenizer for the driver's workload, the plugin classes, and its state before any step."""

    description: str
    kernel_description: str | None
    threads: ThreadChoice | None
    num_devices: int  # the devices one replica's KV cache is split over (its tensor-parallel ranks)
    kv_cache_spec: KVCacheSpec
    kv_layout: KVLayout | None  # how its model's layers share block tables (allocator.kv_groups)
    tokenizer: Tokenizer | None
    vocab_size: int | None
    eos_token_ids: frozenset[int]
    plugin_classes: dict[str, str]
    caches_prefixes: bool
    node: str  # the address of the Ray node it runs on
    state: StepReport
