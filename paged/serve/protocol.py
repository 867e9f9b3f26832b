"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) read into checked prompts and
`SamplingParams`: what vLLM's and SGLang's benchmark clients and the `openai` client send. Every
check happens here, before the engine sees the request, and a bad value is a `BadRequest` naming
its field (the HTTP 400 body's `param`). Fields this server does not know are ignored, as vLLM
ignores them: a client's extras must not fail a run.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from paged.api.inputs import Prompt, check_conversations, check_prompts, render_chat, show
from paged.request import MAX_LOGPROBS, SamplingParams

# OpenAI's default for /v1/completions; a chat without a limit generates until max_model_len
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400): `param` is the body field at fault, None for the body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Limits:
    """What the engine behind the server accepts: the served model's name, its context length,
    the most sequences one request may run at once (scheduler.max_num_seqs) and its vocabulary."""

    model_name: str
    max_model_len: int
    max_num_seqs: int
    vocab_size: int | None


@dataclass(frozen=True)
class GenerateCall:
    """One checked request: its prompts (a completions call may send several), their parameters,
    and how the answer is shaped. `top_logprobs` is the number of alternatives per token the
    response lists (None: no log-probabilities)."""

    chat: bool
    prompts: list[Prompt]
    params: SamplingParams
    stream: bool
    include_usage: bool
    top_logprobs: int | None


# SamplingParams' own fields a body may set, and the JSON type each must have
_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
_INTS = ("n", "top_k", "seed", "min_tokens")
_BOOLS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")


def parse_call(body: Any, *, chat: bool, limits: Limits, tokenizer: Any) -> GenerateCall:
    """`body` (the decoded JSON) of a chat or completions request, checked against `limits`."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {show(body)}")
    model = body.get("model")
    if model is not None and model != limits.model_name:
        raise BadRequest(f"model {model!r} is not served here; this server serves {limits.model_name!r}", "model")
    stream = _bool(body, "stream", False)
    include_usage = _stream_options(body, stream)
    prompt_field = "messages" if chat else "prompt"
    prompts = _chat_prompts(body, tokenizer, limits) if chat else _completion_prompts(body, tokenizer, limits)
    if _bool(body, "echo", False):
        raise BadRequest("echo=true is not supported: the response holds the completion only", "echo")
    max_tokens = _max_tokens(body, chat)
    for prompt in prompts:
        if len(prompt.token_ids) > limits.max_model_len:
            raise BadRequest(
                f"the prompt has {len(prompt.token_ids)} tokens, more than max_model_len={limits.max_model_len}",
                prompt_field,
            )
        if max_tokens is not None and len(prompt.token_ids) + max_tokens > limits.max_model_len:
            field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
            raise BadRequest(
                f"{field}={max_tokens} and the prompt's {len(prompt.token_ids)} tokens exceed "
                f"max_model_len={limits.max_model_len}; {field} <= {limits.max_model_len - len(prompt.token_ids)} "
                "fits",
                field,
            )
    top_logprobs = _logprobs(body, chat)
    params = _sampling_params(body, max_tokens, top_logprobs)
    if params.best_of > limits.max_num_seqs:
        field = "best_of" if body.get("best_of") is not None else "n"
        raise BadRequest(
            f"{field}={params.best_of} needs more sequences than the engine runs at once "
            f"(max_num_seqs={limits.max_num_seqs})",
            field,
        )
    if stream and params.best_of != params.n:
        raise BadRequest("best_of > n cannot stream: the best n are known only at the end", "best_of")
    return GenerateCall(chat, prompts, params, stream, include_usage, top_logprobs)


def _completion_prompts(body: dict[str, Any], tokenizer: Any, limits: Limits) -> list[Prompt]:
    """`prompt`: a str, a list of str, a list of token ids, or a list of token id lists."""
    raw = body.get("prompt")
    if raw is None:
        raise BadRequest("prompt is required: a string, a list of strings or a list of token ids", "prompt")
    if isinstance(raw, list) and raw and all(_is_int(t) for t in raw):
        raw = [raw]
    elif isinstance(raw, str):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise BadRequest(f"prompt must be a string, a list of strings or of token ids, got {show(raw)}", "prompt")
    try:
        return check_prompts(raw, tokenizer, limits.vocab_size, limits.model_name)
    except (TypeError, ValueError) as err:
        raise BadRequest(str(err), "prompt") from err


def _chat_prompts(body: dict[str, Any], tokenizer: Any, limits: Limits) -> list[Prompt]:
    """`messages` rendered through the model's chat template, as `LLM.chat` renders them; a content
    given as OpenAI's list of parts keeps its text parts, joined by newlines (as vLLM joins them)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest(f"messages must be a non-empty list of messages, got {show(messages)}", "messages")
    flat = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and isinstance(message.get("content"), list):
            message = {**message, "content": _text_parts(i, message["content"])}
        flat.append(message)
    hf = getattr(tokenizer, "hf", tokenizer)
    try:
        return render_chat(hf, check_conversations(flat), None, True, limits.vocab_size)
    except (TypeError, ValueError) as err:
        raise BadRequest(str(err), "messages") from err


def _text_parts(i: int, parts: list[Any]) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest(f"message {i}: only text content parts are supported, got {show(part)}", "messages")
        texts.append(part["text"])
    return "\n".join(texts)


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    """The output limit: chat's `max_completion_tokens` (OpenAI's newer name) before `max_tokens`;
    None (chat only, by default): what max_model_len leaves after the prompt."""
    for field in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        value = body.get(field)
        if value is not None:
            if not _is_int(value) or value < 1:
                raise BadRequest(f"{field} must be an integer >= 1, got {show(value)}", field)
            return int(value)
    return None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Alternatives per token: chat's `logprobs: true` with `top_logprobs: k`, completions' `logprobs: k`."""
    if chat:
        if not _bool(body, "logprobs", False):
            return None
        field, value = "top_logprobs", body.get("top_logprobs", 0)
    else:
        field, value = "logprobs", body.get("logprobs")
        if value is None:
            return None
    if value is None:
        value = 0
    if not _is_int(value) or not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(f"{field} must be an integer in [0, {MAX_LOGPROBS}], got {show(value)}", field)
    return int(value)


def _sampling_params(body: dict[str, Any], max_tokens: int | None, top_logprobs: int | None) -> SamplingParams:
    kwargs: dict[str, Any] = {"max_tokens": max_tokens, "logprobs": top_logprobs}
    for name in _FLOATS:
        if (value := body.get(name)) is not None:
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise BadRequest(f"{name} must be a number, got {show(value)}", name)
            kwargs[name] = float(value)
    for name in (*_INTS, "best_of"):
        if (value := body.get(name)) is not None:
            if not _is_int(value):
                raise BadRequest(f"{name} must be an integer, got {show(value)}", name)
            kwargs[name] = int(value)
    for name in _BOOLS:
        if name in body:
            kwargs[name] = _bool(body, name, False)
    if (stop := body.get("stop")) is not None:
        if not isinstance(stop, str) and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise BadRequest(f"stop must be a string or a list of strings, got {show(stop)}", "stop")
        kwargs["stop"] = stop
    if (ids := body.get("stop_token_ids")) is not None:
        if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
            raise BadRequest(f"stop_token_ids must be a list of token ids, got {show(ids)}", "stop_token_ids")
        kwargs["stop_token_ids"] = ids
    try:
        return SamplingParams(**kwargs)
    except ValueError as err:
        # SamplingParams' messages begin with the field they are about ("top_p must be in (0, 1]...")
        field = str(err).split(" ", 1)[0]
        raise BadRequest(str(err), field if field in body else None) from err


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    """Whether a streamed response ends with a usage-only chunk (`stream_options.include_usage`)."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BadRequest(f"stream_options must be an object, got {show(options)}", "stream_options")
    if not stream:
        raise BadRequest("stream_options is only allowed with stream=true", "stream_options")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise BadRequest(f"stream_options.include_usage must be a boolean, got {show(include)}", "stream_options")
    return include


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be a boolean, got {show(value)}", name)
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
