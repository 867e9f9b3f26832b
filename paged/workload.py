"""Request sources: synthetic ShareGPT-like lengths, a JSONL prompt file, or a scaled trace replay.

The synthetic generator is a log-normal *fit* to the ShareGPT means quoted by the PagedAttention
paper (prompt 161.31, output 337.99 tokens), not the dataset itself; lengths are scaled by
`length_scale` and clipped so a CPU run stays short. Prompt text is cut from a built-in corpus so a
real model reads real language. A bad entry never stops a run: it becomes an item carrying an
`error`, which the engine turns into an aborted request with that reason.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from paged.config import WorkloadConfig
from paged.request import SamplingParams

_LOGNORMAL_SIGMA = 1.0
_SAMPLING_KEYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos", "n")
_PROMPT_FILE_KEYS = ("prompt", *_SAMPLING_KEYS, "priority")


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass
class WorkloadItem:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | None
    arrival_time: float = 0.0
    prompt: str | None = None
    priority: int = 0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def load_workload(cfg: WorkloadConfig, tokenizer: Tokenizer) -> list[WorkloadItem]:
    if cfg.kind == "synthetic":
        return synthetic(cfg, tokenizer)
    if cfg.kind == "prompts":
        return prompt_file(cfg, tokenizer)
    if cfg.kind == "trace":
        return trace(cfg, tokenizer)
    raise ValueError(f"workload.kind={cfg.kind!r} is not supported; allowed: synthetic, prompts, trace")


def _lognormal_lengths(rng: np.random.Generator, mean: float, n: int, lo: int, hi: int) -> np.ndarray:
    mu = np.log(mean) - _LOGNORMAL_SIGMA**2 / 2
    return np.clip(np.round(rng.lognormal(mu, _LOGNORMAL_SIGMA, n)), lo, hi).astype(int)


def _arrivals(rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
    """Poisson arrivals at `rate` requests/s; rate 0 submits everything at t = 0."""
    if rate <= 0:
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, n))


class _TextSource:
    """Slices token windows of any length out of the corpus, wrapping around at its end."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        text = resources.files("paged.data").joinpath("corpus.txt").read_text()
        self.tokens = np.asarray(tokenizer.encode(text), dtype=np.int64)

    def window(self, start: int, length: int) -> list[int]:
        idx = (start + np.arange(length)) % len(self.tokens)
        return self.tokens[idx].tolist()


def _length_items(
    cfg: WorkloadConfig,
    tokenizer: Tokenizer,
    prompt_lens: np.ndarray,
    output_lens: np.ndarray,
    arrivals: np.ndarray,
    rng: np.random.Generator,
) -> list[WorkloadItem]:
    source = _TextSource(tokenizer)
    prefix = source.window(0, cfg.shared_prefix_len)
    items = []
    for i, (p_len, o_len, t) in enumerate(zip(prompt_lens, output_lens, arrivals)):
        body = source.window(int(rng.integers(len(source.tokens))), int(p_len))
        params = SamplingParams(max_tokens=int(o_len), temperature=cfg.temperature, ignore_eos=cfg.ignore_eos)
        items.append(WorkloadItem(f"req-{i}", prefix + body, params, float(t)))
    return items


def synthetic(cfg: WorkloadConfig, tokenizer: Tokenizer) -> list[WorkloadItem]:
    rng = np.random.default_rng(cfg.seed)
    n = cfg.num_requests
    prompt_lens = _lognormal_lengths(
        rng, cfg.prompt_len_mean * cfg.length_scale, n, cfg.prompt_len_min, cfg.prompt_len_max
    )
    output_lens = _lognormal_lengths(
        rng, cfg.output_len_mean * cfg.length_scale, n, cfg.output_len_min, cfg.output_len_max
    )
    return _length_items(cfg, tokenizer, prompt_lens, output_lens, _arrivals(rng, cfg.arrival_rate, n), rng)


def trace(cfg: WorkloadConfig, tokenizer: Tokenizer) -> list[WorkloadItem]:
    """Replay a contiguous window of an Azure trace: arrival gaps × time_scale, lengths × length_scale."""
    path = Path(str(cfg.path)).expanduser()
    if not path.is_file():
        traces = resources.files("paged.data").joinpath("traces")
        if not traces.joinpath(str(cfg.path)).is_file():
            names = sorted(p.name for p in traces.iterdir() if p.name.endswith(".csv"))
            raise FileNotFoundError(
                f"workload.path={cfg.path!r}: no such trace file; shipped traces: {', '.join(names)}"
            )
        path = Path(str(traces.joinpath(str(cfg.path))))
    with path.open() as f:
        rows = list(csv.DictReader(f))
    required = {"arrived_at", "num_prefill_tokens", "num_decode_tokens"}
    if not rows or not required <= set(rows[0]):
        raise ValueError(f"trace {path} must have columns {sorted(required)}")
    rng = np.random.default_rng(cfg.seed)
    n = min(cfg.num_requests, len(rows))
    start = int(rng.integers(0, len(rows) - n + 1))
    window = rows[start : start + n]
    t0 = float(window[0]["arrived_at"])
    arrivals = np.array([(float(r["arrived_at"]) - t0) * cfg.time_scale for r in window])

    def scaled(key: str, lo: int, hi: int) -> np.ndarray:
        values = np.array([float(r[key]) for r in window]) * cfg.length_scale
        return np.clip(np.round(values), lo, hi).astype(int)

    prompt_lens = scaled("num_prefill_tokens", cfg.prompt_len_min, cfg.prompt_len_max)
    output_lens = scaled("num_decode_tokens", cfg.output_len_min, cfg.output_len_max)
    return _length_items(cfg, tokenizer, prompt_lens, output_lens, arrivals, rng)


def parse_prompt_line(
    line: str, index: int, line_no: int, tokenizer: Tokenizer, defaults: WorkloadConfig
) -> WorkloadItem:
    """One JSONL line -> an item; anything wrong with it becomes the item's `error`."""
    request_id = f"req-{index}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return WorkloadItem(request_id, [], None, error=f"line {line_no} is not valid JSON: {e.msg}")
    if not isinstance(record, dict):
        return WorkloadItem(request_id, [], None, error=f"line {line_no} is not a JSON object")
    unknown = sorted(set(record) - set(_PROMPT_FILE_KEYS))
    if unknown:
        return WorkloadItem(
            request_id, [], None,
            error=f"line {line_no}: unknown keys {unknown}; allowed: {', '.join(_PROMPT_FILE_KEYS)}",
        )
    prompt = record.get("prompt")
    if not isinstance(prompt, str):
        return WorkloadItem(request_id, [], None, error=f"line {line_no}: 'prompt' must be a string, got {prompt!r}")
    tokens = tokenizer.encode(prompt) if prompt else []
    options = {k: record[k] for k in _SAMPLING_KEYS if k in record}
    options.setdefault("temperature", defaults.temperature)
    try:
        params = SamplingParams(**options)
    except (TypeError, ValueError) as e:
        return WorkloadItem(request_id, tokens, None, prompt=prompt, error=f"line {line_no}: {e}")
    return WorkloadItem(request_id, tokens, params, prompt=prompt, priority=int(record.get("priority", 0)))


def prompt_file(cfg: WorkloadConfig, tokenizer: Tokenizer) -> list[WorkloadItem]:
    path = Path(str(cfg.path)).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"workload.path={cfg.path!r}: no such prompt file")
    numbered = [(n, line) for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    items = [parse_prompt_line(line, i, n, tokenizer, cfg) for i, (n, line) in enumerate(numbered)]
    rng = np.random.default_rng(cfg.seed)
    for item, t in zip(items, _arrivals(rng, cfg.arrival_rate, len(items))):
        item.arrival_time = float(t)
    return items
