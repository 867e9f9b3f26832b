"""Prompt files: requests from real prompt text, one JSON object per line (`jsonl.parse_prompt_line`).

The length-only sources exercise memory and scheduling with prompts cut to sampled lengths; a
prompt file runs given prompts, each with its own sampling (vLLM's SamplingParams fields), for runs
whose output text matters. It needs a tokenizer to encode the prompts.

The file is UTF-8 (a byte order mark opening it is skipped); lines are numbered from 1 over all
lines, blank ones included, split on \\n, \\r\\n and \\r only. A bad line, a line that is not UTF-8
included, becomes an item carrying an `error` (the engine aborts that request with the reason) and
the rest of the file runs, with one warning saying how many lines were bad. A file with no line
that can run (none at all, or every one bad) is a config error before any model loads
(`check_prompt_file`). Clients and priorities are drawn once the request count is known, and
arrivals are Poisson at `arrival_rate`, as for the length-only sources.
"""

from __future__ import annotations

import codecs
import logging
from pathlib import Path

import numpy as np

from paged.config import ConfigError, WorkloadConfig
from paged.workload.jsonl import parse_prompt_line
from paged.workload.records import Tokenizer, WorkloadItem, arrivals, request_mix, workload_sampling

log = logging.getLogger(__name__)


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
    """The items of the JSONL file `cfg.path`, one per non-blank line; logs one warning when some
    lines cannot run (their requests are aborted with the reason)."""
    items = _items(cfg, tokenizer)
    bad = [item.error for item in items if item.error is not None]
    if bad:
        log.warning(
            "workload.path=%r: %d of %d prompt lines cannot run; their requests are aborted with the reason "
            "(the first: %s)", cfg.path, len(bad), len(items), bad[0],
        )
    return items


def check_prompt_file(cfg: WorkloadConfig) -> None:
    """Before any model loads: the file exists and is readable, and at least one line can run (each
    line parsed as `prompt_file` will, its prompt not yet tokenized); a ConfigError names the file."""
    items = _items(cfg, _NoTokenizer())
    if not items:
        raise ConfigError(f"workload.path={cfg.path!r}: the prompt file has no prompts (it is empty or blank)")
    if all(item.error is not None for item in items):
        raise ConfigError(
            f"workload.path={cfg.path!r}: none of its {len(items)} prompt lines can run; the first: {items[0].error}"
        )


class _NoTokenizer:
    """Parses a prompt file's lines without a model: what is wrong with a line does not depend on its tokens."""

    def encode(self, text: str) -> list[int]:
        return []


def _items(cfg: WorkloadConfig, tokenizer: Tokenizer) -> list[WorkloadItem]:
    path = Path(str(cfg.path)).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"workload.path={cfg.path!r}: no such prompt file")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"workload.path={cfg.path!r}: the prompt file cannot be read ({e.strerror})") from None
    defaults = workload_sampling(cfg)
    # Decoded line by line, so one line that is not UTF-8 is that item's error, not the run's end.
    # Splitting the bytes on \n, \r\n and \r only (not str.splitlines' U+2028 and the like, which
    # JSON allows inside a string) keeps the line numbers an editor shows.
    lines: list[tuple[int, str | UnicodeDecodeError]] = []
    for line_no, raw in enumerate(data.removeprefix(codecs.BOM_UTF8).splitlines(), start=1):
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
