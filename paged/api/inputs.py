"""What the LLM API accepts as prompts, sampling parameters and chat messages, checked where a call
enters (`LLM.generate`, `LLM.beam_search`, `LLM.chat`): every prompt of a call is checked before any
reaches the engine, so a bad one fails the call, in one line naming it, with nothing submitted.

Prompts are vLLM's: a str, a list of int token ids (each in [0, vocab_size)), or a dict
{"prompt": str} / {"prompt_token_ids": [...]} (with an optional "cache_salt": str). Bytes are
refused rather than read as token ids.
"""

from __future__ import annotations

import numbers
import reprlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from paged.request import SamplingParams

ACCEPTED = (
    'a prompt is a str, a list of int token ids, or a dict {"prompt": str} / {"prompt_token_ids": [int, ...]}'
)
_DICT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
_MESSAGE = "a message is a dict {'role': str, 'content': str}"

_short = reprlib.Repr()
_short.maxlist = _short.maxtuple = 6
_short.maxstring = _short.maxother = 60


def show(value: object) -> str:
    """`value`'s type and a shortened repr, for one-line errors."""
    return f"{type(value).__name__} {_short.repr(value)}"


@dataclass(frozen=True)
class Prompt:
    """One checked prompt: its token ids, its text when given as text, and its prefix-cache salt."""

    token_ids: list[int]
    text: str | None = None
    cache_salt: str | None = None


def split_prompts(prompts: Any) -> list[Any]:
    """One prompt or a list of them, as a list: a list of ints is one prompt of token ids."""
    if isinstance(prompts, str | dict):
        return [prompts]
    if _is_list(prompts):
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        if all(_is_int(t) for t in prompts):
            return [prompts]
        return list(prompts)
    raise TypeError(f"prompts is {show(prompts)}; {ACCEPTED}, or a list of them{_bytes_hint(prompts)}")


def check_prompts(prompts: Sequence[Any], tokenizer: Any, vocab_size: int | None, what: str) -> list[Prompt]:
    """Each of `prompts` checked and tokenized (text needs `tokenizer`; token ids must be below
    `vocab_size` where it is known); `what` describes the model for the no-tokenizer error."""
    return [_prompt(i, raw, tokenizer, vocab_size, what) for i, raw in enumerate(prompts)]


def _prompt(i: int, raw: Any, tokenizer: Any, vocab_size: int | None, what: str) -> Prompt:
    cache_salt = None
    if isinstance(raw, dict):
        unknown = sorted(set(raw) - set(_DICT_KEYS), key=str)
        if unknown:
            raise ValueError(f"prompt {i} has unknown key(s) {unknown}; a dict prompt allows {list(_DICT_KEYS)}")
        if ("prompt" in raw) == ("prompt_token_ids" in raw):
            raise ValueError(
                f"prompt {i} needs exactly one of 'prompt' (a str) and 'prompt_token_ids' (a list of ints), got "
                f"keys {sorted(raw)}"
            )
        cache_salt = raw.get("cache_salt")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"prompt {i}: cache_salt must be a str, got {show(cache_salt)}")
        if "prompt" in raw:
            raw = raw["prompt"]
            if not isinstance(raw, str):
                raise TypeError(f"prompt {i}: 'prompt' must be a str, got {show(raw)}{_bytes_hint(raw)}")
        else:
            raw = raw["prompt_token_ids"]
            if not _is_list(raw):
                raise TypeError(f"prompt {i}: 'prompt_token_ids' must be a list of ints, got {show(raw)}")
    if isinstance(raw, str):
        if not raw:
            raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
        if tokenizer is None:
            raise ValueError(f"prompt {i} is text, but the model has no tokenizer ({what}): pass token id lists")
        # checked too: a tokenizer may know more tokens than the model embeds
        return Prompt(_token_ids(f"prompt {i}", tokenizer.encode(raw), vocab_size), raw, cache_salt)
    if not _is_list(raw):
        raise TypeError(f"prompt {i} is {show(raw)}; {ACCEPTED}{_bytes_hint(raw)}")
    if not raw:
        raise ValueError(f"prompt {i} is empty: a prompt needs at least one token")
    return Prompt(_token_ids(f"prompt {i}", raw, vocab_size), None, cache_salt)


def _token_ids(where: str, raw: Sequence[Any], vocab_size: int | None) -> list[int]:
    ids = []
    for pos, token in enumerate(raw):
        if not _is_int(token):
            raise TypeError(f"{where}: token id at position {pos} is {show(token)}; token ids are ints")
        token = int(token)
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"{where}: token id {token} at position {pos} is outside the vocabulary {bound}")
        ids.append(token)
    return ids


def check_params(sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: one for all, one each, or None (vLLM's defaults)."""
    if sampling_params is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num_prompts
    if not _is_list(sampling_params):
        hint = " (build one with SamplingParams(**...))" if isinstance(sampling_params, dict) else ""
        raise TypeError(
            f"sampling_params must be a SamplingParams, a list of them (one per prompt) or None, got "
            f"{show(sampling_params)}{hint}"
        )
    for j, params in enumerate(sampling_params):
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params[{j}] is {show(params)}; each must be a SamplingParams")
    if len(sampling_params) != num_prompts:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {num_prompts} prompts")
    return list(sampling_params)


def check_conversations(messages: Any) -> list[list[dict[str, Any]]]:
    """One conversation (a list of message dicts) or a list of them, as a list of conversations,
    each message's role and content checked."""
    if _is_list(messages) and messages and all(isinstance(m, dict) for m in messages):
        conversations = [list(messages)]
    elif _is_list(messages) and messages and all(_is_list(c) for c in messages):
        conversations = [list(c) for c in messages]
    else:
        raise TypeError(
            f"messages must be a conversation (a list of messages) or a list of conversations; {_MESSAGE}; "
            f"got {show(messages)}"
        )
    for c, conversation in enumerate(conversations):
        if not conversation:
            raise ValueError(f"conversation {c} is empty: it needs at least one message")
        for m, message in enumerate(conversation):
            where = f"conversation {c}, message {m}"
            if not isinstance(message, dict):
                raise TypeError(f"{where} is {show(message)}; {_MESSAGE}")
            for key in ("role", "content"):
                if key not in message:
                    raise ValueError(f"{where} has no {key!r} (keys {sorted(message)}); {_MESSAGE}")
                if not isinstance(message[key], str):
                    raise TypeError(f"{where}: {key} must be a str, got {show(message[key])}")
    return conversations


def render_chat(
    tokenizer: Any,
    conversations: list[list[dict[str, Any]]],
    chat_template: str | None,
    add_generation_prompt: bool,
    vocab_size: int | None,
) -> list[Prompt]:
    """Each conversation through the HF tokenizer's chat template (or `chat_template`, a Jinja
    template), as vLLM does: the rendered text, then its tokens (the template writes any BOS)."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template: pass chat_template=... (a Jinja "
            "template), or use generate() with plain prompts"
        )
    from jinja2 import TemplateError  # what transformers renders templates with (only chat needs it)

    prompts = []
    for c, conversation in enumerate(conversations):
        try:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt, tokenize=False,
            )
        except TemplateError as err:
            raise ValueError(f"conversation {c}: the chat template failed: {err}") from err
        token_ids = _token_ids(f"conversation {c}", tokenizer.encode(text, add_special_tokens=False), vocab_size)
        if not token_ids:
            raise ValueError(f"conversation {c} renders to an empty prompt")
        prompts.append(Prompt(token_ids, text))
    return prompts


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_list(value: object) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes | bytearray)


def _bytes_hint(value: object) -> str:
    return " (bytes are not read as text or token ids: decode them to a str)" if isinstance(
        value, bytes | bytearray) else ""
