"""What a run leaves behind: summary.json, requests.jsonl (DESIGN.md contract) and a console table."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from paged.engine.metrics import RequestMetrics
from paged.request import Completion, Request
from paged.step import scores_tokens
from paged.utils.atomic_file import atomic_open, write_text

# a tokenizer's `decode(token_ids, skip_special_tokens=...)`
Decode = Callable[..., str]


def completion_text(c: Completion, skip_special_tokens: bool, decode: Decode | None) -> str | None:
    """A completion's text: as detokenized while it grew (already cut at its stop string), else
    decoded now under the request's `skip_special_tokens`; None without a tokenizer."""
    if c.text is not None or decode is None:
        return c.text
    return decode(c.token_ids, skip_special_tokens=skip_special_tokens)


def _completion_record(c: Completion, skip_special_tokens: bool, decode: Decode | None, scored: bool) -> dict[str, Any]:
    record: dict[str, Any] = {
        "index": c.index,
        "output_token_ids": c.token_ids,
        "finish_reason": c.finish_reason.value if c.finish_reason else None,
        # null where the sampler computed no log-probabilities (`scores_tokens`), as vLLM V1 reports it
        "cumulative_logprob": c.cumulative_logprob if scored else None,
    }
    if c.stop_reason is not None:
        record["stop_reason"] = c.stop_reason
    text = completion_text(c, skip_special_tokens, decode)
    if text is not None:
        record["output_text"] = text
    if c.logprobs is not None:
        # JSON keys are strings: per token, [token id, log-probability, rank] of each entry
        record["logprobs"] = [[[t, lp, rank] for t, (lp, rank) in entry.items()] for entry in c.logprobs]
    return record


def request_record(request: Request, metrics: RequestMetrics, decode: Decode | None) -> dict:
    """One requests.jsonl line: `output_token_ids` / `output_text` of the best completion (the top
    beam, or sample 0), and `outputs` with every completion."""
    skip, scored = request.params.skip_special_tokens, scores_tokens(request.params)
    completions = [_completion_record(c, skip, decode, scored) for c in request.outputs()]
    best = completions[0] if completions else {"output_token_ids": []}
    record: dict[str, Any] = {
        "request_id": request.request_id,
        "prompt_len": request.num_prompt_tokens,
        "output_token_ids": best["output_token_ids"],
        "finish_reason": metrics.finish_reason,
        # seconds on the engine clock (simulated under executor=sim); None where not reached
        "arrival_time": request.arrival_time,
        "first_token_time": request.first_token_time,
        "finish_time": request.finish_time,
        "output_len": metrics.output_len,
        "ttft_s": metrics.ttft_s,
        "tpot_s": metrics.tpot_s,
        "e2e_latency_s": metrics.e2e_latency_s,
        "num_preemptions": request.num_preemptions,
        "priority": request.priority,
        "client_id": request.client_id,
    }
    if "output_text" in best:
        record["output_text"] = best["output_text"]
    if request.abort_reason is not None:
        record["abort_reason"] = request.abort_reason
    if metrics.kv_transfer_s is not None:  # disaggregated: its KV's copy from prefill to decode replica
        record["kv_transfer_s"] = metrics.kv_transfer_s
    record["outputs"] = completions
    return record


def write_outputs(
    run_dir: Path,
    summary: dict[str, Any],
    requests: list[Request],
    metrics: list[RequestMetrics],
    decode: Decode | None,
) -> None:
    """requests.jsonl (one line per request and its metrics, in order), then summary.json: each
    whole or not at all, so that a summary.json (which marks a job done) never sits beside a cut
    requests.jsonl. Raises OutputError naming the file that could not be written."""
    with atomic_open(run_dir / "requests.jsonl") as f:
        for request, m in zip(requests, metrics, strict=True):
            f.write(json.dumps(request_record(request, m, decode)) + "\n")
    write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")


_SHOWN = [
    ("num_requests", "requests", "{}"),
    ("num_finished", "finished", "{}"),
    ("num_aborted", "aborted", "{}"),
    ("num_not_started", "not started", "{}"),
    ("num_preemptions", "preemptions", "{}"),
    ("output_tokens_per_s", "output tokens/s", "{:.1f}"),
    ("requests_per_s", "requests/s", "{:.3f}"),
    ("ttft_mean_s", "TTFT mean (s)", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 (s)", "{:.3f}"),
    ("tpot_mean_s", "TPOT mean (s)", "{:.4f}"),
    ("tpot_p99_s", "TPOT p99 (s)", "{:.4f}"),
    ("e2e_latency_mean_s", "e2e latency mean (s)", "{:.3f}"),
    ("normalized_latency_s_per_token", "normalized latency (s/token)", "{:.4f}"),
    ("kv_usage_mean", "KV usage mean", "{:.3f}"),
    ("token_state_fraction_mean", "token-state fraction mean", "{:.3f}"),
    ("kv_sharing_saving_mean", "KV saved by sharing, mean", "{:.3f}"),
    ("prefix_cache_hit_rate", "prefix cache hit rate", "{:.3f}"),
    ("client_service_ratio", "client service ratio (max/min)", "{:.2f}"),
    ("engine_overhead_fraction", "engine overhead fraction", "{:.3f}"),
    ("wall_time_s", "wall time (s)", "{:.2f}"),
    ("kv_blocks_in_use_end", "KV blocks in use at end", "{}"),
]


def print_summary(summary: dict[str, Any], title: str, console: Console | None = None) -> None:
    table = Table(title=title, show_header=True)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, label, fmt in _SHOWN:
        value = summary.get(key)
        table.add_row(label, "n/a" if value is None else fmt.format(value))
    (console or Console()).print(table)
