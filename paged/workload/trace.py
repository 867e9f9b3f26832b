"""Trace replay: a window of a production LLM inference trace, lengths and arrival gaps as served.

A synthetic fit has the right means but an assumed spread and Poisson arrivals; a trace has the real
joint distribution of prompt lengths, output lengths and arrival gaps. `path` names a CSV with the
columns `arrived_at` (s), `num_prefill_tokens` and `num_decode_tokens`: a file, or one of the traces
shipped in paged/data/traces (Azure's 2023 conversation and code traces). A contiguous window of
`num_requests` rows (the whole trace when None) starts at a row drawn from the request stream. The
lengths are scaled by `length_scale` and clipped to [`*_len_min`, `*_len_max`], the arrival gaps
scaled by `time_scale` (conf/workload/trace.yaml scales both down for a CPU run), with the first
request at t = 0.
"""

from __future__ import annotations

import csv
from importlib import resources
from pathlib import Path

import numpy as np

from paged.config import ConfigError, WorkloadConfig
from paged.workload.lengths import Lengths


def trace_lengths(cfg: WorkloadConfig, rng: np.random.Generator) -> Lengths:
    """A contiguous window of an Azure trace (all of it when num_requests is None): arrival gaps ×
    time_scale, lengths × length_scale."""
    table = read_trace(str(cfg.path))
    n = len(table) if cfg.num_requests is None else min(cfg.num_requests, len(table))
    start = int(rng.integers(0, len(table) - n + 1))
    arrived, prefill, decode = table[start : start + n].T

    def scaled(values: np.ndarray, lo: int, hi: int | None) -> np.ndarray:
        return np.clip(np.round(values * cfg.length_scale), lo, hi).astype(np.int64)

    return Lengths(
        scaled(prefill, cfg.prompt_len_min, cfg.prompt_len_max),
        scaled(decode, cfg.output_len_min, cfg.output_len_max),
        (arrived - arrived[0]) * cfg.time_scale,
    )


def read_trace(name: str) -> np.ndarray:
    """The trace's rows as (arrived_at, num_prefill_tokens, num_decode_tokens); `name` is a file path
    or the name of a shipped trace."""
    path = _trace_path(name)
    with path.open() as f:
        header = next(csv.reader(f), [])
        required = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
        if not set(required) <= set(header):
            raise ValueError(f"trace {path} must have columns {sorted(required)}")
        columns = [header.index(key) for key in required]
        table = np.loadtxt(f, delimiter=",", usecols=columns, ndmin=2)
    if not len(table):
        raise ValueError(f"trace {path} has no rows")
    return table


def check_trace(cfg: WorkloadConfig) -> None:
    """Before any model loads: the trace exists, is readable, has the columns and at least one row;
    a ConfigError (FileNotFoundError for a missing file) names it."""
    path = _trace_path(str(cfg.path))
    required = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
    try:
        with path.open() as f:
            reader = csv.reader(f)
            header, first = next(reader, []), next(reader, None)
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ConfigError(f"workload.path={cfg.path!r}: the trace {path} cannot be read ({e})") from None
    if not set(required) <= set(header):
        raise ConfigError(f"workload.path={cfg.path!r}: the trace {path} must have the columns {sorted(required)}")
    if not first:
        raise ConfigError(f"workload.path={cfg.path!r}: the trace {path} has no rows")


def _trace_path(name: str) -> Path:
    """A file path, or the name of a trace shipped in paged/data/traces."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    traces = resources.files("paged.data").joinpath("traces")
    if not traces.joinpath(name).is_file():
        names = sorted(p.name for p in traces.iterdir() if p.name.endswith(".csv"))
        raise FileNotFoundError(f"workload.path={name!r}: no such trace file; shipped traces: {', '.join(names)}")
    return Path(str(traces.joinpath(name)))
