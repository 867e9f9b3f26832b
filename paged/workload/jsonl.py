"""One line of a JSONL prompt file to a request; whatever is wrong with the line becomes its error.

A line is a JSON object with `prompt` (a string), an optional integer `priority`, an optional
string `client`, and any SamplingParams constructor field under vLLM's name (`max_tokens`, `stop`,
`logprobs`, `min_tokens`, `use_beam_search`, ...), each checked against that field's annotated
type. The workload's sampling keys and its drawn client and priority are defaults a line's own keys
override, so a line without `temperature` samples at the workload's (0.0, greedy), not at
SamplingParams' 1.0.

A bad line never stops a run: it becomes an item carrying an `error` that names the line, which the
engine turns into an aborted request with that reason, and the other lines run.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from typing import Any

from paged.request import SamplingParams
from paged.workload.records import Tokenizer, WorkloadItem

# A prompt line may set every SamplingParams constructor field (vLLM's names), each as annotated
# there; derived fields (`stop_strings`) are not inputs.
_SAMPLING_FIELDS = {f.name: f.type for f in dataclasses.fields(SamplingParams) if f.init}
_SAMPLING_HINTS = typing.get_type_hints(SamplingParams)
_PROMPT_FILE_KEYS = ("prompt", *_SAMPLING_FIELDS, "priority", "client")
# The JSON values an annotated type accepts: an integer is a valid float, a bool is no number.
_JSON_TYPES: dict[Any, tuple[type, ...]] = {
    int: (int,), float: (int, float), bool: (bool,), str: (str,), type(None): (type(None),)
}


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
    the workload's sampling keys (`records.workload_sampling`), which the line's own keys override;
    so do its `client` and `priority` override `client_id` and `priority`, the workload's draws for
    this request. An item with an error keeps the drawn client: it is still that client's request."""
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


def _line_params(record: dict[str, Any], defaults: dict[str, Any]) -> SamplingParams:
    """A prompt line's sampling keys over the workload's defaults. A value of the wrong type raises
    naming its key: SamplingParams would take "false" for a true flag, or fail without the name."""
    options = {key: value for key, value in record.items() if key in _SAMPLING_FIELDS}
    for key, value in options.items():
        if not _json_fits(value, _SAMPLING_HINTS[key]):
            raise ValueError(f"{key} must be {_SAMPLING_FIELDS[key]}, got {value!r}")
    return SamplingParams(**{**defaults, **options})


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
