"""Prompt files: requests from real prompt text, one JSON object per line (`jsonl.parse_prompt_line`).

The length-only sources exercise memory and scheduling with prompts cut to sampled lengths; a
prompt file runs given prompts, each with its own sampling (vLLM's SamplingParams fields), for runs
whose output text matters. It needs a tokenizer to encode the prompts.

The file is UTF-8 (a byte order mark opening it is skipped); lines are numbered from 1 over all
lines, blank ones included, split on \\n, \\r\\n and \\r only. A bad line, a line that is not UTF-8
included, becomes an item carrying an `error` (the engine aborts that request with the reason) and
the rest of the file runs. Clients and priorities are drawn once the request count is known, and
arrivals are Poisson at `arrival_rate`, as for the length-only sources.
"""

from __future__ import annotations

import codecs
from pathlib import Path

import numpy as np

from paged.config import WorkloadConfig
from paged.workload.jsonl import parse_prompt_line
from paged.workload.records import Tokenizer, WorkloadItem, arrivals, request_mix, workload_sampling


def prompt_source(
    cfg: WorkloadConfig,
    tokenizer: Tokenizer | None,
    *,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> list[WorkloadItem]:
    """`prompt_file` for a model with a tokenizer. `vocab_size` and `max_model_len` go unused: the
    prompts are the file's own, taken as written."""
    if tokenizer is None:
        raise ValueError(
            "workload=prompts needs a model with a tokenizer; a spec-only model has no vocabulary to "
            "encode prompts with, so use workload=synthetic, fixed or trace"
        )
    return prompt_file(cfg, tokenizer)


def prompt_file(cfg: WorkloadConfig, tokenizer: Tokenizer) -> list[WorkloadItem]:
    """The items of the JSONL file `cfg.path`, one per non-blank line."""
    path = Path(str(cfg.path)).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"workload.path={cfg.path!r}: no such prompt file")
    defaults = workload_sampling(cfg)
    # Decoded line by line, so one line that is not UTF-8 is that item's error, not the run's end.
    # Splitting the bytes on \n, \r\n and \r only (not str.splitlines' U+2028 and the like, which
    # JSON allows inside a string) keeps the line numbers an editor shows.
    lines: list[tuple[int, str | UnicodeDecodeError]] = []
    for line_no, raw in enumerate(path.read_bytes().removeprefix(codecs.BOM_UTF8).splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            lines.append((line_no, e))
            continue
        if line.strip():
            lines.append((line_no, line))
    # drawn once the request count is known, as for the length-only workloads
    clients, priorities = request_mix(cfg, len(lines))
    items = []
    for index, ((line_no, line), client, priority) in enumerate(zip(lines, clients, priorities)):
        if isinstance(line, UnicodeDecodeError):
            # column: the bad byte's 1-based offset among the line's bytes (no character is there)
            bad = f"byte 0x{line.object[line.start]:02x} at column {line.start + 1}"
            error = f"line {line_no} is not valid UTF-8 ({bad})"
            items.append(WorkloadItem(f"req-{index}", [], None, priority=priority, client_id=client, error=error))
        else:
            items.append(
                parse_prompt_line(line, index, line_no, tokenizer, defaults, client_id=client, priority=priority)
            )
    rng = np.random.default_rng(cfg.seed)
    for item, t in zip(items, arrivals(rng, cfg.arrival_rate, len(items))):
        item.arrival_time = float(t)
    return items
