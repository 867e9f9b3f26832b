"""Per-step and per-request metrics, and the flat summary that `summary.json` carries (DESIGN.md).

A disaggregated fleet's KV transfers are records of their own (`TransferRecord`): they overlap the
steps of both replicas rather than take part in one."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from paged.engine.held_steps import Hold
from paged.engine.pooled_gaps import GapStats, gap_stats, pooled_gaps
from paged.engine.slo import goodput
from paged.engine.step_record import StepRecord
from paged.engine.step_stats import StepStats, record_step
from paged.request import FinishReason, Request, Sequence
from paged.step import ExecutorOutput, KVStats, SchedulerOutput, SchedulerStats


@dataclass
class RequestMetrics:
    request_id: str
    prompt_len: int
    output_len: int
    finish_reason: str
    abort_reason: str | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_latency_s: float | None
    normalized_latency_s_per_token: float | None
    num_preemptions: int
    # seconds its KV took from a prefill replica to a decode replica (None: it was not moved)
    kv_transfer_s: float | None = None

    @classmethod
    def of(cls, request: Request) -> RequestMetrics:
        output_len = max((len(c.token_ids) for c in request.outputs()), default=0)
        reason = request.finish_reason
        ttft = e2e = tpot = norm = None
        if request.first_token_time is not None:
            ttft = request.first_token_time - request.arrival_time
        if request.finish_time is not None and reason is not FinishReason.ABORTED:
            e2e = request.finish_time - request.arrival_time
            if output_len > 0:
                norm = e2e / output_len
            if output_len > 1 and ttft is not None:
                tpot = (e2e - ttft) / (output_len - 1)
        return cls(
            request_id=request.request_id,
            prompt_len=request.num_prompt_tokens,
            output_len=output_len,
            finish_reason=reason.value if reason is not None else "unfinished",
            abort_reason=request.abort_reason,
            ttft_s=ttft,
            tpot_s=tpot,
            e2e_latency_s=e2e,
            normalized_latency_s_per_token=norm,
            num_preemptions=request.num_preemptions,
            kv_transfer_s=request.kv_transfer_s,
        )


@dataclass(frozen=True)
class TransferRecord:
    """One request's KV moved from a prefill replica to a decode replica (disaggregated prefill):
    ready when its prefill sampled the first token, started once the decode replica held blocks
    for it and the prefill replica's link was free, ended when the last byte landed."""

    request_id: str
    prefill_replica: int
    decode_replica: int
    link: str  # "nvlink" (one node) or "network" (across nodes)
    num_blocks: int
    num_bytes: int
    ready_s: float
    start_s: float
    end_s: float

    @property
    def transfer_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def wait_s(self) -> float:
        """Held on the prefill replica before the copy began (decode memory or seats, a busy link)."""
        return self.start_s - self.ready_s


# a list of per-request values (the pooled inter-token gaps, millions, are `paged.engine.pooled_gaps`'s)
Values = list[float]


def _mean(values: Values) -> float | None:
    return float(np.mean(values)) if len(values) else None


def _percentile(values: Values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _latencies(name: str, values: Values) -> dict[str, float | None]:
    """`<name>_mean_s` and the p50 / p90 / p99 percentiles (`<name>_p50_s`, ...)."""
    return {f"{name}_mean_s": _mean(values), **{f"{name}_p{q}_s": _percentile(values, q) for q in (50, 90, 99)}}


def _benchmark_latencies(name: str, seconds: Values) -> dict[str, float | None]:
    """vLLM benchmark_serving's `mean_<name>_ms`, `median_`, `std_`, `p90_`, `p99_`: computed on
    seconds and scaled as it does (np.std: the population deviation); None without values."""
    if not len(seconds):
        return {f"{stat}_{name}_ms": None for stat in ("mean", "median", "std", "p90", "p99")}
    return {
        f"mean_{name}_ms": float(np.mean(seconds)) * 1000,
        f"median_{name}_ms": float(np.median(seconds)) * 1000,
        f"std_{name}_ms": float(np.std(seconds)) * 1000,
        f"p90_{name}_ms": float(np.percentile(seconds, 90)) * 1000,
        f"p99_{name}_ms": float(np.percentile(seconds, 99)) * 1000,
    }


def _gap_latencies(itl: GapStats | None) -> dict[str, float | None]:
    """`_latencies("itl", gaps)` from the gaps' statistics."""
    values = (None,) * 4 if itl is None else (itl.mean, itl.p50, itl.p90, itl.p99)
    return dict(zip(("itl_mean_s", "itl_p50_s", "itl_p90_s", "itl_p99_s"), values))


def _gap_benchmark_latencies(itl: GapStats | None) -> dict[str, float | None]:
    """`_benchmark_latencies("itl", gaps)` from the gaps' statistics."""
    names = ("mean_itl_ms", "median_itl_ms", "std_itl_ms", "p90_itl_ms", "p99_itl_ms")
    if itl is None:
        return dict.fromkeys(names)
    return dict(zip(names, (v * 1000 for v in (itl.mean, itl.median, itl.std, itl.p90, itl.p99))))


# VTC's service weights (OSDI'24): a prompt token costs 1, a generated token 2
SERVICE_WEIGHTS = (1.0, 2.0)


class MetricsRecorder:
    """Collects step and request records; listeners (console, W&B) see each step as it happens.

    With requests from two or more clients it also measures fairness as the VTC paper does: the
    service (prompt tokens + 2 x generated tokens) each client receives over the steps in which every
    client that has sent a request has one waiting (all are backlogged: each would take more)."""

    def __init__(self, keep_steps: bool = True) -> None:
        self.requests: list[Request] = []
        # every step's record, kept while `keep_steps` (the API's and the tests' view of a run); the
        # summary reads `step_stats`, which streams them, so a long run need not keep them
        self.keep_steps = keep_steps
        self.steps: list[StepRecord] = []
        self.step_stats = StepStats()
        self.step_listeners: list[Callable[[StepRecord], None]] = []
        self.client_service: dict[str, float] = {}
        self.transfers: list[TransferRecord] = []

    def on_add(self, request: Request) -> None:
        self.requests.append(request)
        if request.client_id is not None:
            self.client_service.setdefault(request.client_id, 0.0)

    def on_scheduled(self, sched: SchedulerOutput, waiting: Collection[Sequence]) -> None:
        """A step is about to run: its rows are service to their clients when every client has a
        request `waiting` (VTC's backlogged clients: each would take more than it gets)."""
        # fewer waiting sequences than clients leave one idle: answered without building the set of
        # clients every step (a fleet's tenants number in the thousands)
        if len(self.client_service) < 2 or len(waiting) < len(self.client_service):
            return
        idle = set(self.client_service)
        for seq in waiting:
            idle.discard(seq.request.client_id)
            if not idle:
                break
        if idle:
            return
        prompt_weight, output_weight = SERVICE_WEIGHTS
        for item in sched.scheduled:
            client = item.seq.request.client_id
            if client is not None:
                weight = output_weight if item.is_decode else prompt_weight
                self.client_service[client] += item.num_new_tokens * weight

    def on_step(
        self, sched: SchedulerOutput, output: ExecutorOutput, stats: SchedulerStats, start: float, end: float,
        hold: Hold | None = None,
    ) -> None:
        """A step ran: its record is counted, or with `hold` (a fleet's replica, where no record is
        kept or listened to) its statistics are held for their turn (`HeldSteps`)."""
        record = self.step_record(
            sched.is_prefill, len(sched.scheduled), sched.num_decode_rows, sched.num_batched_tokens,
            output.num_computed_tokens, sum(map(len, output.sampled)), output.model_time_s,
            output.attention_version, len(sched.preempted),
            len(sched.blocks_to_swap_out) + len(sched.blocks_to_swap_in), stats, start, end,
        )
        if hold is not None and not self.records_steps:
            hold(start, record_step(record))
        else:
            self.add_step(record)

    @staticmethod
    def step_record(
        is_prefill: bool, batch_size: int, num_decode_rows: int, num_scheduled_tokens: int, num_computed_tokens: int,
        num_sampled_tokens: int, model_time_s: float, attention_version: str | None, num_preempted: int,
        num_swap_blocks: int, stats: SchedulerStats, start: float, end: float,
    ) -> StepRecord:
        """A step's record (numbered when `add_step` counts it): what ran, from `start` to `end`,
        and the queues and cache after it (`stats`)."""
        kv = stats.kv
        shares = kv.breakdown()
        return StepRecord(
            engine_step=0,
            time_s=end,
            is_prefill=is_prefill,
            batch_size=batch_size,
            num_decode_rows=num_decode_rows,
            num_scheduled_tokens=num_scheduled_tokens,
            num_computed_tokens=num_computed_tokens,
            num_sampled_tokens=num_sampled_tokens,
            step_time_s=end - start,
            overhead_s=max(0.0, end - start - model_time_s),
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_preempted=num_preempted,
            kv_usage=kv.kv_usage,
            token_state_fraction=kv.token_state_fraction,
            kv_token_state_fraction=shares["token_state"],
            kv_reserved_fraction=shares["reserved"],
            kv_internal_frag_fraction=shares["internal_frag"],
            kv_external_frag_fraction=shares["external_frag"],
            kv_free_fraction=shares["free"],
            kv_sharing_saving=kv.sharing_saving,
            num_logical_blocks=kv.num_logical_blocks,
            num_swapped=stats.num_swapped,
            num_swap_blocks=num_swap_blocks,
            num_allocated_blocks=kv.num_allocated_blocks,
            num_cached_free_blocks=kv.num_cached_free_blocks,
            prefix_queried_tokens=kv.num_queried_tokens,
            prefix_hit_tokens=kv.num_hit_tokens,
            attention_version=attention_version,
            kv_tokens_held=kv.tokens_held,
        )

    def add_step(self, record: StepRecord) -> None:
        """Number a step's record, count it in the statistics, keep it (`keep_steps`) and show it to
        the listeners."""
        record.engine_step = self.step_stats.num_steps + 1
        self.step_stats.add(record)
        if self.keep_steps:
            self.steps.append(record)
        for listener in self.step_listeners:
            listener(record)

    @property
    def records_steps(self) -> bool:
        """Whether a step needs its `StepRecord` (kept or listened to), else `step_stats` counts it
        (fast-forward's `decode_step`s)."""
        return self.keep_steps or bool(self.step_listeners)

    def on_transfer(self, record: TransferRecord) -> None:
        """A request's KV reached its decode replica."""
        self.transfers.append(record)

    def client_service_ratio(self) -> float | None:
        """Most over least service between clients while all were backlogged; None with fewer than
        two clients or no such step."""
        service = self.client_service.values()
        if len(service) < 2 or not any(service):
            return None
        return max(service) / max(min(service), 1.0)

    def request_metrics(self) -> list[RequestMetrics]:
        return [RequestMetrics.of(r) for r in self.requests]

    def summary(
        self, *, kv_end: KVStats, caches_prefixes: bool, slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None, bytes_per_block: int | None = None,
    ) -> dict[str, Any]:
        """The flat summary.json metrics; `kv_end` is the cache after the run. `goodput` counts the
        finished requests that meet both SLOs (one not given is met), per second of the run.
        `bytes_per_block` (one KV block's) prices `kv_bytes_per_token_mean`: None leaves it None."""
        per_request = self.request_metrics()
        finished = [
            (r, m) for r, m in zip(self.requests, per_request)
            if m.finish_reason in (FinishReason.LENGTH.value, FinishReason.STOP.value)
        ]
        done = [m for _, m in finished]
        finish_times = [r.finish_time for r in self.requests if r.finish_time is not None]
        arrivals = [r.arrival_time for r in self.requests]
        wall = (max(finish_times) - min(arrivals)) if finish_times and arrivals else 0.0
        # the tokens of the completions returned (best_of and pruned beams are work, not output)
        useful_tokens = sum(
            sum(len(c.token_ids) for c in r.outputs()) for r in self.requests if r.abort_reason is None
        )
        ttfts = [m.ttft_s for m in done if m.ttft_s is not None]
        tpots = [m.tpot_s for m in done if m.tpot_s is not None]
        e2els = [m.e2e_latency_s for m in done if m.e2e_latency_s is not None]
        itl = gap_stats(pooled_gaps([r.token_times for r, _ in finished]))
        input_tokens = sum(m.prompt_len for m in done)
        # the best completion's tokens, as vLLM's client counts one output per request
        output_tokens = sum(m.output_len for m in done)
        requests_per_s = len(done) / wall if wall > 0 else 0.0
        steps = self.step_stats.summary(bytes_per_block)
        hit_rate = None
        if caches_prefixes and kv_end.num_queried_tokens > 0:
            hit_rate = kv_end.num_hit_tokens / kv_end.num_queried_tokens
        return {
            "num_requests": len(self.requests),
            "num_finished": len(done),
            "num_aborted": sum(m.finish_reason == FinishReason.ABORTED.value for m in per_request),
            "num_preemptions": sum(m.num_preemptions for m in per_request),
            "output_tokens": useful_tokens,
            "prompt_tokens": sum(m.prompt_len for m in per_request),
            "computed_tokens": steps["computed_tokens"],
            "output_tokens_per_s": useful_tokens / wall if wall > 0 else 0.0,
            "requests_per_s": requests_per_s,
            **_latencies("ttft", ttfts),
            **_latencies("tpot", tpots),
            **_gap_latencies(itl),
            **_latencies("e2e_latency", e2els),
            "normalized_latency_s_per_token": _mean(
                [m.normalized_latency_s_per_token for m in done if m.normalized_latency_s_per_token is not None]
            ),
            "kv_usage_mean": steps["kv_usage_mean"],
            "kv_usage_max": steps["kv_usage_max"],
            "token_state_fraction_mean": steps["token_state_fraction_mean"],
            "kv_token_state_fraction_mean": steps["kv_token_state_fraction_mean"],
            "kv_reserved_fraction_mean": steps["kv_reserved_fraction_mean"],
            "kv_internal_frag_fraction_mean": steps["kv_internal_frag_fraction_mean"],
            "kv_external_frag_fraction_mean": steps["kv_external_frag_fraction_mean"],
            "kv_free_fraction_mean": steps["kv_free_fraction_mean"],
            "kv_token_state_of_used_mean": steps["kv_token_state_of_used_mean"],
            "kv_sharing_saving_mean": steps["kv_sharing_saving_mean"],
            "num_running_mean": steps["num_running_mean"],
            "kv_tokens_held_mean": steps["kv_tokens_held_mean"],
            "kv_tokens_held_max": steps["kv_tokens_held_max"],
            "kv_bytes_per_token_mean": steps["kv_bytes_per_token_mean"],
            "prefix_cache_hit_rate": hit_rate,
            "wall_time_s": wall,
            "num_engine_steps": steps["num_engine_steps"],
            "mean_decode_batch_size": steps["mean_decode_batch_size"],
            "engine_overhead_fraction": steps["engine_overhead_fraction"],
            "decode_steps_v1": steps["decode_steps_v1"],
            "decode_steps_v2": steps["decode_steps_v2"],
            "decode_steps_v3": steps["decode_steps_v3"],
            "client_service_ratio": self.client_service_ratio(),
            **goodput(((m.ttft_s, m.tpot_s) for m in done), len(self.requests), wall, slo_ttft_s, slo_tpot_s),
            **_transfer_summary(self.transfers),
            "kv_blocks_in_use_end": kv_end.num_allocated_blocks,
            "num_total_blocks": kv_end.num_total_blocks,
            # vLLM benchmark_serving's names and definitions: finished requests only, milliseconds
            "duration": wall,
            "completed": len(done),
            "total_input_tokens": input_tokens,
            "total_output_tokens": output_tokens,
            "request_throughput": requests_per_s,
            "output_throughput": output_tokens / wall if wall > 0 else 0.0,
            "total_token_throughput": (input_tokens + output_tokens) / wall if wall > 0 else 0.0,
            **_benchmark_latencies("ttft", ttfts),
            **_benchmark_latencies("tpot", tpots),
            **_gap_benchmark_latencies(itl),
            **_benchmark_latencies("e2el", e2els),
        }


def _transfer_summary(transfers: list[TransferRecord]) -> dict[str, Any]:
    """The KV moved between a disaggregated fleet's pools: count, bytes, copy time, and the time KV
    waited on its prefill replica for decode memory or the link (zeros without disaggregation)."""
    seconds = [t.transfer_s for t in transfers]
    return {
        "num_kv_transfers": len(transfers),
        "kv_transfer_bytes": sum(t.num_bytes for t in transfers),
        "kv_transfer_total_s": float(sum(seconds)),
        **_latencies("kv_transfer", seconds),
        "kv_transfer_wait_mean_s": _mean([t.wait_s for t in transfers]),
    }
