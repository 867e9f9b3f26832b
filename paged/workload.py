"""Request sources: ShareGPT/Alpaca-like synthetic lengths, fixed lengths, a scaled trace replay, or
a JSONL prompt file.

The synthetic generator is a log-normal *fit* to the mean lengths the PagedAttention paper quotes
(ShareGPT: prompt 161.31, output 337.99 tokens; Alpaca: 19.31, 58.45), not the datasets: the paper
gives no spread, so the fit assumes sigma = 1.0 for the log-length and sets mu so the means match.
Lengths are scaled by `length_scale`. A trace replay takes a window of `num_requests` rows (the
whole trace when None) with the trace's lengths scaled the same way and its arrival gaps scaled by
`time_scale`; `fixed` gives every request exactly `prompt_len` and `output_len`.

`shared_prefix_len` tokens, the same in every request, are prepended to each sampled (synthetic,
trace) prompt; for `fixed` they are part of `prompt_len`. With `num_prefixes` k > 1 there are k
distinct prefixes of that length and each request gets one at random, so requests sharing a prefix
interleave in arrival order (a shuffled shared-prefix workload, for longest-prefix-match studies).

Clients and priorities: with `num_clients` k > 0 each request names a client, `client-0` ..
`client-{k-1}`, drawn in proportion to `client_weights` (equal shares when None); with 0 it names
none (`client_id` None). With `num_priorities` k > 0 each request's priority is uniform in [0, k);
with 0 it is 0. The per-request draws (client, priority, which prefix) each come from their own
stream seeded by `seed`, so turning them on changes no length, arrival or token id of the rest.

Lengths are clipped in two steps. Sampled lengths are first clipped to the config's
[`*_len_min`, `*_len_max`] (a None max means no such limit). Then, when the caller passes the
scheduler's `max_model_len`, every length-only workload (synthetic, fixed, trace) is cut to fit it,
as the paper's setup cuts sequences to the model's max length: the whole prompt (prefix included) to
at most `max_model_len - 1` tokens, so at least one token can be generated, then the output so that
prompt + output <= `max_model_len`. This second step wins over `*_len_min`.

Sampling: every length-only request gets the workload's `temperature` (default 0.0, greedy, not
SamplingParams' 1.0), `ignore_eos`, `n`, `best_of`, `use_beam_search` and `length_penalty`. A
combination SamplingParams rejects (beam search with n = 1, n = 0, ...) raises a ValueError naming
the `workload.` keys before any request is built.

Prompt files are JSONL: per line an object with `prompt` (a string), an optional integer
`priority`, an optional string `client`, and any SamplingParams constructor field under vLLM's name
(`stop`, `logprobs`, `min_tokens`, `use_beam_search`, ...). The workload's `temperature`, `n`,
`best_of`, `use_beam_search` and `length_penalty`, and its drawn client and priority, are defaults a
line's own keys override, so a line without `temperature` samples at the workload's (0.0, greedy),
not at SamplingParams' 1.0. The file is UTF-8
(a byte order mark opening it is skipped); lines are numbered from 1 over all lines, blank ones
included.

Token ids: with a tokenizer, prompts are windows of a built-in corpus so a real model reads real
language. A spec-only model has no tokenizer, so its length-only workloads get seeded uniform ids in
[0, vocab_size). Either way the shared prefix is the same ids in every request, so prefix caching
hashes and hits exactly as on a real model. A bad entry of a prompt file never stops a run: it
becomes an item carrying an `error`, which the engine turns into an aborted request with that reason.
"""

from __future__ import annotations

import codecs
import csv
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from paged.config import WorkloadConfig
from paged.request import SamplingParams

_LOGNORMAL_SIGMA = 1.0
# A prompt line may set every SamplingParams constructor field (vLLM's names), each as annotated
# there; derived fields (`stop_strings`) are not inputs.
_SAMPLING_FIELDS = {f.name: f.type for f in dataclasses.fields(SamplingParams) if f.init}
_SAMPLING_HINTS = typing.get_type_hints(SamplingParams)
_PROMPT_FILE_KEYS = ("prompt", *_SAMPLING_FIELDS, "priority", "client")
# The workload keys that set every request's sampling (for prompt files: the defaults of each line)
_WORKLOAD_SAMPLING_KEYS = ("temperature", "n", "best_of", "use_beam_search", "length_penalty")
# The JSON values an annotated type accepts: an integer is a valid float, a bool is no number.
_JSON_TYPES: dict[Any, tuple[type, ...]] = {
    int: (int,), float: (int, float), bool: (bool,), str: (str,), type(None): (type(None),)
}
# Seeds the synthetic prefix ids apart from the request stream, so the prefix does not change with
# the request count or lengths (as the corpus prefix does not).
_PREFIX_STREAM = 1
# Per-request draws each have their own stream too, so turning one on (or changing its setting)
# leaves the lengths, arrivals, ids and the other draws of every request as they were.
_CLIENT_STREAM = 2
_PRIORITY_STREAM = 3
_PREFIX_CHOICE_STREAM = 4


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
    client_id: str | None = None  # None: the workload names no clients
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class _Lengths(NamedTuple):
    """Per request: prompt tokens after the shared prefix, output tokens, arrival time (s)."""

    body: np.ndarray
    output: np.ndarray
    arrival: np.ndarray


def load_workload(
    cfg: WorkloadConfig,
    tokenizer: Tokenizer | None,
    *,
    vocab_size: int | None = None,
    max_model_len: int | None = None,
) -> list[WorkloadItem]:
    """The requests `cfg` describes. `tokenizer` None (a spec-only model) draws synthetic ids below
    `vocab_size`; `max_model_len` (the scheduler's) clips length-only workloads to fit it."""
    if cfg.kind == "prompts":
        if tokenizer is None:
            raise ValueError(
                "workload=prompts needs a model with a tokenizer; a spec-only model has no vocabulary to "
                "encode prompts with, so use workload=synthetic, fixed or trace"
            )
        return prompt_file(cfg, tokenizer)
    if cfg.kind not in _LENGTH_SOURCES:
        raise ValueError(
            f"workload.kind={cfg.kind!r} is not supported; allowed: {', '.join(_LENGTH_SOURCES)}, prompts"
        )
    if cfg.num_requests is None and cfg.kind != "trace":
        raise ValueError(
            "workload.num_requests=None (the whole trace) is only for workload=trace; "
            f"workload={cfg.kind} needs a request count"
        )
    if max_model_len is not None and cfg.shared_prefix_len >= max_model_len:
        raise ValueError(
            f"workload.shared_prefix_len={cfg.shared_prefix_len} leaves no room to generate: it must be "
            f"< scheduler.max_model_len={max_model_len}"
        )
    sampling = _workload_sampling(cfg)
    rng = np.random.default_rng(cfg.seed)
    lengths = _LENGTH_SOURCES[cfg.kind](cfg, rng)
    body, output = lengths.body, lengths.output
    if max_model_len is not None:
        body = np.minimum(body, max_model_len - 1 - cfg.shared_prefix_len)
        output = np.minimum(output, max_model_len - cfg.shared_prefix_len - body)
    if tokenizer is not None:
        prefixes, bodies = _corpus_ids(tokenizer, cfg.shared_prefix_len, cfg.num_prefixes, body, rng)
    elif vocab_size is not None:
        prefixes, bodies = _random_ids(cfg, vocab_size, body, rng)
    else:
        raise ValueError(
            f"workload={cfg.kind} without a tokenizer (a spec-only model) needs vocab_size= to draw "
            "synthetic token ids"
        )
    distinct = len(set(map(tuple, prefixes)))
    if distinct < len(prefixes):
        # short prefixes of a small vocabulary or corpus can coincide; two equal ones would be one
        # prefix to the cache, silently fewer than asked for
        raise ValueError(
            f"workload.num_prefixes={cfg.num_prefixes}: only {distinct} distinct prefixes "
            f"of workload.shared_prefix_len={cfg.shared_prefix_len} tokens could be drawn; use fewer or longer "
            "prefixes"
        )
    prefix_rng = np.random.default_rng([cfg.seed, _PREFIX_CHOICE_STREAM])
    prefix_of = prefix_rng.integers(len(prefixes), size=len(bodies)).tolist()
    clients, priorities = _request_mix(cfg, len(bodies))
    # read once: a DictConfig attribute costs microseconds, too much per request at paper scale
    sampling["ignore_eos"] = cfg.ignore_eos
    items = []
    per_request = zip(bodies, output.tolist(), lengths.arrival.tolist(), prefix_of, clients, priorities)
    for i, (ids, o_len, t, p, client, priority) in enumerate(per_request):
        params = SamplingParams(max_tokens=o_len, **sampling)
        items.append(WorkloadItem(f"req-{i}", prefixes[p] + ids, params, t, priority=priority, client_id=client))
    return items


def _request_mix(cfg: WorkloadConfig, n: int) -> tuple[list[str | None], list[int]]:
    """Per request: the client it names (None when `num_clients` is 0) and its priority."""
    clients: list[str | None] = [None] * n
    if cfg.num_clients > 0:
        weights = np.ones(cfg.num_clients) if cfg.client_weights is None else np.array(list(cfg.client_weights))
        names = [f"client-{k}" for k in range(cfg.num_clients)]
        drawn = np.random.default_rng([cfg.seed, _CLIENT_STREAM]).choice(
            cfg.num_clients, size=n, p=weights / weights.sum()
        )
        clients = [names[k] for k in drawn.tolist()]
    priorities = [0] * n
    if cfg.num_priorities > 0:
        priorities = np.random.default_rng([cfg.seed, _PRIORITY_STREAM]).integers(cfg.num_priorities, size=n).tolist()
    return clients, priorities


def _workload_sampling(cfg: WorkloadConfig) -> dict[str, Any]:
    """The workload's sampling keys, checked once here so that a combination SamplingParams rejects
    fails before the run, naming the workload keys, rather than on every request."""
    sampling = {key: getattr(cfg, key) for key in _WORKLOAD_SAMPLING_KEYS}
    try:
        SamplingParams(**sampling)
    except ValueError as e:
        # json.dumps writes the values as a Hydra override would (true, null), ready to correct
        settings = " ".join(f"workload.{key}={json.dumps(value)}" for key, value in sampling.items())
        raise ValueError(f"{settings} is not a valid sampling setup: {e}") from None
    return sampling


def _lognormal_lengths(
    rng: np.random.Generator, mean: float, n: int, lo: int, hi: int | None
) -> np.ndarray:
    mu = np.log(mean) - _LOGNORMAL_SIGMA**2 / 2
    return np.clip(np.round(rng.lognormal(mu, _LOGNORMAL_SIGMA, n)), lo, hi).astype(np.int64)


def _arrivals(rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
    """Poisson arrivals at `rate` requests/s; rate 0 submits everything at t = 0."""
    if rate <= 0:
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / rate, n))


def _synthetic_lengths(cfg: WorkloadConfig, rng: np.random.Generator) -> _Lengths:
    n = cfg.num_requests
    prompt = _lognormal_lengths(
        rng, cfg.prompt_len_mean * cfg.length_scale, n, cfg.prompt_len_min, cfg.prompt_len_max
    )
    output = _lognormal_lengths(
        rng, cfg.output_len_mean * cfg.length_scale, n, cfg.output_len_min, cfg.output_len_max
    )
    return _Lengths(prompt, output, _arrivals(rng, cfg.arrival_rate, n))


def _fixed_lengths(cfg: WorkloadConfig, rng: np.random.Generator) -> _Lengths:
    n = cfg.num_requests
    body = np.full(n, cfg.prompt_len - cfg.shared_prefix_len, dtype=np.int64)
    return _Lengths(body, np.full(n, cfg.output_len, dtype=np.int64), _arrivals(rng, cfg.arrival_rate, n))


def _trace_lengths(cfg: WorkloadConfig, rng: np.random.Generator) -> _Lengths:
    """A contiguous window of an Azure trace (all of it when num_requests is None): arrival gaps ×
    time_scale, lengths × length_scale."""
    path = _trace_path(str(cfg.path))
    with path.open() as f:
        header = next(csv.reader(f), [])
        required = ("arrived_at", "num_prefill_tokens", "num_decode_tokens")
        if not set(required) <= set(header):
            raise ValueError(f"trace {path} must have columns {sorted(required)}")
        columns = [header.index(key) for key in required]
        table = np.loadtxt(f, delimiter=",", usecols=columns, ndmin=2)
    if not len(table):
        raise ValueError(f"trace {path} has no rows")
    n = len(table) if cfg.num_requests is None else min(cfg.num_requests, len(table))
    start = int(rng.integers(0, len(table) - n + 1))
    arrived, prefill, decode = table[start : start + n].T

    def scaled(values: np.ndarray, lo: int, hi: int | None) -> np.ndarray:
        return np.clip(np.round(values * cfg.length_scale), lo, hi).astype(np.int64)

    return _Lengths(
        scaled(prefill, cfg.prompt_len_min, cfg.prompt_len_max),
        scaled(decode, cfg.output_len_min, cfg.output_len_max),
        (arrived - arrived[0]) * cfg.time_scale,
    )


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


_LENGTH_SOURCES = {"synthetic": _synthetic_lengths, "fixed": _fixed_lengths, "trace": _trace_lengths}


def _split(flat: np.ndarray, lengths: np.ndarray) -> list[list[int]]:
    """Cut `flat`, an object array of Python ints, into one list per request. The lists point at
    the array's int objects, so each distinct id is one object (not 32 bytes per token, millions of
    tokens at paper scale), and no int is created per token."""
    ends = np.cumsum(lengths).tolist()
    return [flat[end - n : end].tolist() for end, n in zip(ends, lengths.tolist())]


def _corpus_ids(
    tokenizer: Tokenizer, prefix_len: int, num_prefixes: int, body: np.ndarray, rng: np.random.Generator
) -> tuple[list[list[int]], list[list[int]]]:
    """`num_prefixes` windows of `prefix_len` tokens at evenly spaced corpus starts (the first at
    the corpus's start), and per request a window from a random start; windows wrap around at the
    corpus end."""
    text = resources.files("paged.data").joinpath("corpus.txt").read_text()
    tokens = np.asarray(tokenizer.encode(text), dtype=object)
    # one draw per request, in request order: the same stream as drawing them one by one
    starts = rng.integers(len(tokens), size=len(body))
    offsets = np.arange(int(body.sum())) - np.repeat(np.cumsum(body) - body, body)
    flat = tokens[(np.repeat(starts, body) + offsets) % len(tokens)]
    prefix_starts = np.arange(num_prefixes) * len(tokens) // num_prefixes
    prefixes = tokens[(prefix_starts[:, None] + np.arange(prefix_len)) % len(tokens)].tolist()
    return prefixes, _split(flat, body)


def _random_ids(
    cfg: WorkloadConfig, vocab_size: int, body: np.ndarray, rng: np.random.Generator
) -> tuple[list[list[int]], list[list[int]]]:
    """Seeded uniform ids in [0, vocab_size) for a model without a tokenizer: `num_prefixes`
    prefixes, then the request bodies."""
    vocab = np.arange(vocab_size).astype(object)
    prefix_rng = np.random.default_rng([cfg.seed, _PREFIX_STREAM])
    # row by row from one stream, so prefix 0 is the very ids a single shared prefix has
    prefixes = vocab[prefix_rng.integers(vocab_size, size=(cfg.num_prefixes, cfg.shared_prefix_len))].tolist()
    return prefixes, _split(vocab[rng.integers(vocab_size, size=int(body.sum()))], body)


def _json_fits(value: Any, hint: Any) -> bool:
    """Whether a decoded JSON value has the annotated type `hint` (a SamplingParams field's)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_json_fits(value, arg) for arg in typing.get_args(hint))
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_json_fits(v, item) for v in value)
    accepted = _JSON_TYPES.get(hint)
    if accepted is None:  # a type JSON has no plain form of: SamplingParams' own checks judge it
        return True
    return isinstance(value, accepted) and (hint is bool or not isinstance(value, bool))


def _line_params(record: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    """A prompt line's sampling keys over the workload's defaults. A value of the wrong type raises
    naming its key: SamplingParams would take "false" for a true flag, or fail without the name."""
    options = {key: value for key, value in record.items() if key in _SAMPLING_FIELDS}
    for key, value in options.items():
        if not _json_fits(value, _SAMPLING_HINTS[key]):
            raise ValueError(f"{key} must be {_SAMPLING_FIELDS[key]}, got {value!r}")
    return SamplingParams(**{**defaults, **options})


def parse_prompt_line(
    line: str,
    index: int,
    line_no: int,
    tokenizer: Tokenizer,
    defaults: dict[str, Any],
    *,
    client_id: str | None = None,
    priority: int = 0,
) -> WorkloadItem:
    """One JSONL line -> an item; anything wrong with it becomes the item's `error`. `defaults` are
    the workload's sampling keys (`_workload_sampling`), which the line's own keys override; so do
    its `client` and `priority` override `client_id` and `priority`, the workload's draws for this
    request. An item with an error keeps the drawn client: it is still that client's request."""
    item = WorkloadItem(f"req-{index}", [], None, priority=priority, client_id=client_id)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        return dataclasses.replace(item, error=f"line {line_no} is not valid JSON: {e.msg}")
    if not isinstance(record, dict):
        return dataclasses.replace(item, error=f"line {line_no} is not a JSON object")
    unknown = sorted(set(record) - set(_PROMPT_FILE_KEYS))
    if unknown:
        return dataclasses.replace(
            item, error=f"line {line_no}: unknown keys {unknown}; allowed: {', '.join(_PROMPT_FILE_KEYS)}"
        )
    prompt = record.get("prompt")
    if not isinstance(prompt, str):
        return dataclasses.replace(item, error=f"line {line_no}: 'prompt' must be a string, got {prompt!r}")
    item = dataclasses.replace(item, prompt_token_ids=tokenizer.encode(prompt) if prompt else [], prompt=prompt)
    line_priority = record.get("priority", priority)
    client = record.get("client", client_id)
    try:
        if isinstance(line_priority, bool) or not isinstance(line_priority, int):
            raise ValueError(f"priority must be an integer, got {line_priority!r}")
        if "client" in record and not isinstance(client, str):
            raise ValueError(f"client must be a string, got {client!r}")
        params = _line_params(record, defaults)
    except (TypeError, ValueError) as e:
        return dataclasses.replace(item, error=f"line {line_no}: {e}")
    return dataclasses.replace(item, params=params, priority=line_priority, client_id=client)


def prompt_file(cfg: WorkloadConfig, tokenizer: Tokenizer) -> list[WorkloadItem]:
    """The items of the JSONL file `cfg.path`, one per non-blank line."""
    path = Path(str(cfg.path)).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"workload.path={cfg.path!r}: no such prompt file")
    defaults = _workload_sampling(cfg)
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
    clients, priorities = _request_mix(cfg, len(lines))
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
    for item, t in zip(items, _arrivals(rng, cfg.arrival_rate, len(items))):
        item.arrival_time = float(t)
    return items
