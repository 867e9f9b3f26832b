"""OpenAI response bodies: completions and chat completions, whole or as streamed chunks, their
`usage`, log-probabilities in each endpoint's format, and the error body of a refused request."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from paged.serve.deltas import ChoiceDelta, TokenLogprobs
from paged.serve.protocol import GenerateCall


def error_body(message: str, param: str | None, status: int) -> dict[str, Any]:
    """OpenAI's error object: what its client raises as BadRequestError & co."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class _Choice:
    """A choice's output so far (a non-streamed response is built from it at the end)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    text_offset: int = 0  # completions' logprobs.text_offset: characters sent before the next token


class ResponseWriter:
    """The bodies of one call: `chunks` per update while streaming, `usage_chunk` at its end,
    `response` for a whole one. A prompt's choices are numbered prompt_index * n + index."""

    def __init__(self, call: GenerateCall, model: str, tokenizer: Any) -> None:
        self.call = call
        self.chat = call.chat
        self.model = model
        self.id = f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._tokenizer = tokenizer
        self._choices: dict[int, _Choice] = {}

    def choice_index(self, prompt_index: int, delta: ChoiceDelta) -> int:
        return prompt_index * self.call.params.n + delta.index

    def add(self, prompt_index: int, delta: ChoiceDelta) -> _Choice:
        """Record `delta`; returns its choice."""
        choice = self._choices.setdefault(self.choice_index(prompt_index, delta), _Choice())
        choice.token_ids += delta.token_ids
        choice.text += delta.text
        if delta.logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + delta.logprobs
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        return choice

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p.token_ids) for p in self.call.prompts)
        completion = sum(len(c.token_ids) for c in self._choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def chunk(self, prompt_index: int, delta: ChoiceDelta) -> dict[str, Any] | None:
        """The streamed chunk for `delta` (recorded too); None when it shows the client nothing (a
        token that ends inside a character, without log-probabilities asked for)."""
        index = self.choice_index(prompt_index, delta)
        first = index not in self._choices
        choice = self.add(prompt_index, delta)
        if not delta.text and delta.finish_reason is None and self.call.top_logprobs is None and not (
                first and self.chat):
            return None
        entry: dict[str, Any] = {"index": index}
        if self.chat:
            entry["delta"] = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        else:
            entry["text"] = delta.text
        entry["logprobs"] = self._logprobs(delta.token_ids, delta.logprobs, choice)
        entry["finish_reason"] = delta.finish_reason
        body = self._head("chat.completion.chunk" if self.chat else "text_completion", [entry])
        if self.call.include_usage:
            body["usage"] = None  # OpenAI's: every chunk has it, null but in the last
        return body

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage is set: no choices, the usage."""
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion", []), "usage": self.usage()}

    def response(self) -> dict[str, Any]:
        """The whole response, once every choice finished."""
        entries = []
        for index in sorted(self._choices):
            c = self._choices[index]
            c.text_offset = 0
            logprobs = self._logprobs(c.token_ids, c.logprobs, c)
            if self.chat:
                entries.append({"index": index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": logprobs, "finish_reason": c.finish_reason})
            else:
                entries.append({"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason})
        return {**self._head("chat.completion" if self.chat else "text_completion", entries), "usage": self.usage()}

    def _head(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, token_ids: list[int], entries: list[TokenLogprobs] | None, choice: _Choice) -> Any:
        k = self.call.top_logprobs
        if k is None or entries is None:
            return None
        rows = []
        for token, entry in zip(token_ids, entries, strict=True):
            top = sorted(entry.items(), key=lambda item: item[1][1])[:k]
            rows.append((self._text(token), entry[token][0], [(self._text(t), lp) for t, (lp, _) in top]))
        if self.chat:
            return {"content": [
                {"token": s, "logprob": lp, "bytes": list(s.encode()),
                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top]}
                for s, lp, top in rows
            ]}
        offsets = []
        for s, _, _ in rows:
            offsets.append(choice.text_offset)
            choice.text_offset += len(s)
        return {"tokens": [s for s, _, _ in rows], "token_logprobs": [lp for _, lp, _ in rows],
                "top_logprobs": [dict(top) for _, _, top in rows], "text_offset": offsets}

    def _text(self, token: int) -> str:
        return self._tokenizer.decode([token], skip_special_tokens=False) if self._tokenizer is not None else ""
