"""What a run leaves behind: summary.json, requests.jsonl (DESIGN.md contract) and a console table."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from paged.metrics import RequestMetrics
from paged.request import Request


def request_record(request: Request, metrics: RequestMetrics, decode: Callable[[list[int]], str] | None) -> dict:
    seqs = sorted(request.seqs, key=lambda s: s.index)
    tokens = seqs[0].output_token_ids if seqs else []
    record: dict[str, Any] = {
        "request_id": request.request_id,
        "prompt_len": request.num_prompt_tokens,
        "output_token_ids": tokens,
        "finish_reason": metrics.finish_reason,
        "ttft_s": metrics.ttft_s,
        "e2e_latency_s": metrics.e2e_latency_s,
        "num_preemptions": request.num_preemptions,
    }
    if decode is not None:
        record["output_text"] = decode(tokens)
    if request.abort_reason is not None:
        record["abort_reason"] = request.abort_reason
    if len(seqs) > 1:
        record["n_outputs"] = [
            {
                "output_token_ids": s.output_token_ids,
                "finish_reason": s.finish_reason.value if s.finish_reason else None,
            }
            | ({"output_text": decode(s.output_token_ids)} if decode is not None else {})
            for s in seqs
        ]
    return record


def write_outputs(
    run_dir: Path,
    summary: dict[str, Any],
    requests: list[Request],
    metrics: list[RequestMetrics],
    decode: Callable[[list[int]], str] | None,
) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with (run_dir / "requests.jsonl").open("w") as f:
        for request, m in zip(requests, metrics):
            f.write(json.dumps(request_record(request, m, decode)) + "\n")


_SHOWN = [
    ("num_requests", "requests", "{}"),
    ("num_finished", "finished", "{}"),
    ("num_aborted", "aborted", "{}"),
    ("num_preemptions", "preemptions", "{}"),
    ("output_tokens_per_s", "output tokens/s", "{:.1f}"),
    ("requests_per_s", "requests/s", "{:.3f}"),
    ("ttft_mean_s", "TTFT mean (s)", "{:.3f}"),
    ("ttft_p99_s", "TTFT p99 (s)", "{:.3f}"),
    ("tpot_mean_s", "TPOT mean (s)", "{:.4f}"),
    ("e2e_latency_mean_s", "e2e latency mean (s)", "{:.3f}"),
    ("normalized_latency_s_per_token", "normalized latency (s/token)", "{:.4f}"),
    ("kv_usage_mean", "KV usage mean", "{:.3f}"),
    ("token_state_fraction_mean", "token-state fraction mean", "{:.3f}"),
    ("prefix_cache_hit_rate", "prefix cache hit rate", "{:.3f}"),
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
