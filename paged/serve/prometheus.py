"""`GET /metrics`: the server's engine in Prometheus' text format, with the quantities summary.json
reports (TTFT, TPOT, ITL, end-to-end latency as histograms; KV usage, blocks in use, prefix hits,
preemptions, queue lengths as gauges and counters), named `paged_*` after vLLM's `vllm:*` metrics.

The engine thread writes (a step listener, and each finished request); the HTTP thread renders.
One lock covers both, so a scrape never sees a histogram's count without its sum.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from paged.engine.metrics import RequestMetrics, StepRecord
from paged.request import Request
from paged.step import KVStats

# vLLM's buckets for the same histograms (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, values: np.ndarray | list[float]) -> None:
        values = np.asarray(values, dtype=float)
        if not values.size:
            return
        # per bucket, the values at or below its bound (Prometheus' buckets are cumulative)
        below = np.searchsorted(np.sort(values), self.buckets, side="right")
        self.counts = [c + int(n) for c, n in zip(self.counts, below, strict=True)]
        self.total += float(values.sum())
        self.count += int(values.size)

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        out += [f'{self.name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts, strict=True)]
        return out + [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.total}",
                      f"{self.name}_count {self.count}"]


@dataclass(frozen=True)
class EngineState:
    """The engine between steps, as the engine thread last read it."""

    num_running: int = 0
    num_waiting: int = 0
    kv: KVStats | None = None
    num_preemptions: int = 0


class ServerMetrics:
    """Counters, gauges and histograms of the requests the server ran; `render` is the /metrics body."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ttft = Histogram("paged_time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.tpot = Histogram("paged_time_per_output_token_seconds", "Time per output token after the first.",
                              TOKEN_BUCKETS)
        self.itl = Histogram("paged_inter_token_latency_seconds", "Gaps between a request's token-giving steps.",
                             TOKEN_BUCKETS)
        self.e2e = Histogram("paged_e2e_request_latency_seconds", "Arrival to finish of finished requests.",
                             E2E_BUCKETS)
        self.finished: dict[str, int] = {"length": 0, "stop": 0, "aborted": 0}
        self.num_received = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.num_steps = 0
        self.state = EngineState()

    def on_received(self, request: Request) -> None:
        with self._lock:
            self.num_received += 1
            self.prompt_tokens += request.num_prompt_tokens

    def on_step(self, record: StepRecord) -> None:
        """An engine step listener (`MetricsRecorder.step_listeners`)."""
        with self._lock:
            self.num_steps += 1
            self.generation_tokens += record.num_sampled_tokens

    def on_finished(self, request: Request) -> None:
        m = RequestMetrics.of(request)
        with self._lock:
            self.finished[m.finish_reason] = self.finished.get(m.finish_reason, 0) + 1
            if m.finish_reason == "aborted":
                return
            for histogram, value in ((self.ttft, m.ttft_s), (self.tpot, m.tpot_s), (self.e2e, m.e2e_latency_s)):
                if value is not None:
                    histogram.observe([value])
            self.itl.observe(np.diff(request.token_times))

    def set_state(self, state: EngineState) -> None:
        self.state = state  # one reference swapped: a scrape sees the old state or the new, whole

    def render(self) -> str:
        with self._lock:
            s, kv = self.state, self.state.kv
            lines: list[str] = []
            _metric(lines, "paged_num_requests_running", "gauge", "Requests with a sequence in the batch.",
                    s.num_running)
            _metric(lines, "paged_num_requests_waiting", "gauge", "Requests queued, preempted or swapped out.",
                    s.num_waiting)
            if kv is not None:
                _metric(lines, "paged_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use.",
                        kv.num_allocated_blocks / kv.num_total_blocks if kv.num_total_blocks else 0.0)
                _metric(lines, "paged_kv_blocks_in_use", "gauge", "KV blocks allocated.", kv.num_allocated_blocks)
                _metric(lines, "paged_kv_blocks_total", "gauge", "KV blocks in the pool.", kv.num_total_blocks)
                _metric(lines, "paged_prefix_cache_queries_total", "counter",
                        "Prompt tokens looked up in the prefix cache.", kv.num_queried_tokens)
                _metric(lines, "paged_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
                        kv.num_hit_tokens)
                _metric(lines, "paged_prefix_cache_hit_rate", "gauge", "Prefix-cache hits over lookups (tokens).",
                        kv.num_hit_tokens / kv.num_queried_tokens if kv.num_queried_tokens else 0.0)
            _metric(lines, "paged_num_preemptions_total", "counter", "Preemptions so far.", s.num_preemptions)
            _metric(lines, "paged_requests_received_total", "counter", "Requests submitted to the engine.",
                    self.num_received)
            lines += ["# HELP paged_requests_finished_total Requests ended, by finish reason.",
                      "# TYPE paged_requests_finished_total counter"]
            lines += [f'paged_requests_finished_total{{finish_reason="{r}"}} {n}' for r, n in self.finished.items()]
            _metric(lines, "paged_prompt_tokens_total", "counter", "Prompt tokens received.", self.prompt_tokens)
            _metric(lines, "paged_generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens)
            _metric(lines, "paged_engine_steps_total", "counter", "Engine steps run.", self.num_steps)
            for histogram in (self.ttft, self.tpot, self.itl, self.e2e):
                lines += histogram.lines()
        return "\n".join(lines) + "\n"


def _metric(lines: list[str], name: str, kind: str, help: str, value: float) -> None:
    lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}", f"{name} {value}"]
