"""What one request's choices (its completions) gained since the client last heard: the updates the
engine thread sends the HTTP handlers. A streamed choice sends its new tokens and text after every
step; the last update of each choice holds the rest of the text `LLM.generate` returns, so that the
deltas of a stream join to exactly that text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from paged.api.outputs import Decode, completion_text
from paged.detokenizer import Decoder, IncrementalDetokenizer
from paged.request import Completion, Request, Sequence

# per output token: token id -> (log-probability, rank)
TokenLogprobs = dict[int, tuple[float, int]]


@dataclass
class ChoiceDelta:
    """New output of choice `index` (its place among the request's completions)."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None  # set on a choice's last delta: "length", "stop" or "abort"


@dataclass
class Update:
    """A request's progress, for the submission that sent it: its `prompt_index` among the call's
    prompts, new output per choice, and `done` once it ended (its last deltas included)."""

    prompt_index: int
    deltas: list[ChoiceDelta] = field(default_factory=list)
    done: bool = False


def final_deltas(request: Request, decode: Decode | None, streams: dict[int, ChoiceStream] | None = None) -> list[
        ChoiceDelta]:
    """The finished `request`'s completions as `LLM.generate` returns them, less what `streams`
    (choice index -> its stream) already sent."""
    reason = "abort" if request.abort_reason is not None else None
    deltas = []
    for j, c in enumerate(request.outputs()):
        stream = streams.get(j) if streams is not None else None
        sent_tokens, sent_text = (stream.sent_tokens, stream.sent_text) if stream is not None else (0, 0)
        text = completion_text(c, request.params.skip_special_tokens, decode) or ""
        finish = reason or (c.finish_reason.value if c.finish_reason is not None else "abort")
        deltas.append(ChoiceDelta(
            j, c.token_ids[sent_tokens:], text[sent_text:], _logprobs_from(c, sent_tokens), finish,
        ))
    return deltas


def _logprobs_from(c: Completion, start: int) -> list[TokenLogprobs] | None:
    return None if c.logprobs is None else c.logprobs[start:]


class ChoiceStream:
    """One streamed choice: how many of its tokens and text characters were sent, and its text as it
    grows. A request with stop strings has the scheduler's detokenizer (which cuts at the stop
    string); the last characters a stop string could still take back are held until the end."""

    def __init__(self, request: Request, tokenizer: Decoder | None) -> None:
        params = request.params
        self.sent_tokens = 0
        self.sent_text = 0
        self._holdback = max((len(s) for s in params.stop_strings), default=1) - 1
        self._own: IncrementalDetokenizer | None = None
        if tokenizer is not None and not params.stop_strings:
            self._own = IncrementalDetokenizer(
                tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )

    def advance(self, seq: Sequence, index: int) -> ChoiceDelta | None:
        """`seq`'s output since the last call, or None when it has none."""
        start = seq.num_prompt_tokens + self.sent_tokens
        new = seq.token_ids[start:]
        while new and new[-1] < 0:  # async scheduling's placeholders: tokens the host has not read yet
            new.pop()
        if not new:
            return None
        if self._own is not None:
            for token in new:
                self._own.append(token, check_stop=False)
            text = self._own.text
        elif seq.detokenizer is not None:
            text = seq.detokenizer.text
            text = text[: max(self.sent_text, len(text) - self._holdback)]
        else:
            text = ""
        logprobs = None if seq.logprobs is None else seq.logprobs[self.sent_tokens : self.sent_tokens + len(new)]
        delta = ChoiceDelta(index, new, text[self.sent_text :], logprobs)
        self.sent_tokens += len(new)
        self.sent_text = max(self.sent_text, len(text))
        return delta
