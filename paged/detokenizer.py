"""Incremental detokenization of one generated sequence, with vLLM-style stop strings.

Why incremental: streaming and stop strings need the output text after every token, and decoding the
whole output each step costs O(length) per token, O(length^2) per sequence. Decoding one token at a
time is wrong instead: byte-level BPE splits a multi-byte character (an emoji, most CJK) across
several tokens, each of which decodes alone to U+FFFD, and SentencePiece-style decoders drop the
leading space of a word that starts a decode. So, like vLLM's `detokenize_incrementally`, only a
short window of tokens is decoded: `prefix_offset` marks the start of the window (tokens already
emitted, there only to give the new ones their context) and `read_offset` the first token not yet
emitted; the new text is `decode(window) - decode(window[:read])`. A window whose text ends in
U+FFFD stops at an incomplete character, so nothing is emitted until a later token completes it.

The text is checked against a plain `tokenizer.decode`, not against the transformers token-level
API (`convert_ids_to_tokens` / `convert_tokens_to_string`): with `skip_special_tokens=True` the
former drops every added token marked special while the latter drops only `all_special_ids` (for
SmolLM2, `<repo_name>` and friends survive), and `decode` is what callers compare against.
"""

from __future__ import annotations

from typing import Protocol

# vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET: enough prompt tokens that the first output token
# decodes with the context a full decode would give it.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Output text of one generated sequence, grown one token at a time, with stop strings.

    `text` withholds a trailing incomplete character until the token completing it arrives (a
    sequence cut off mid-character never shows that character, as in vLLM).
    """

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("an empty stop string would stop before the first token")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        # Characters of already emitted text a stop string completed by the next token may start in.
        self._tail_len = max((len(s) for s in self._stop), default=1) - 1

        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character. With it as context, the output's first tokens would
            # complete a prompt character and their bytes would vanish from the output; without it,
            # they decode as `decode(output_ids)` does (to U+FFFD).
            context, context_text = [], ""
        # Only the window tokens[prefix_offset:] is kept, so `_read` is read_offset - prefix_offset.
        self._window = context
        self._read = len(context)
        self._prefix_text = context_text

        # Chunks, joined lazily, so an append never copies the whole text (a caller holding `text`
        # would defeat CPython's in-place `str +=`).
        self._chunks: list[str] = []
        self._tail = ""  # the last `_tail_len` characters of the text
        self._stopped_by: str | None = None

    @property
    def text(self) -> str:
        """The output text so far (never the prompt)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one generated token; returns the stop string it completed (None if none). After a stop,
        `text` is cut before the stop string (or just after it with include_stop_str_in_output).
        `check_stop=False` only grows the text (vLLM ignores stop strings before min_tokens)."""
        if self._stopped_by is not None:
            raise RuntimeError(f"append after the sequence stopped at stop string {self._stopped_by!r}")
        new_text = self._next_text(token_id)
        if not new_text:
            return None
        if not check_stop:
            self._chunks.append(new_text)
            region = self._tail + new_text
            self._tail = region[max(0, len(region) - self._tail_len) :]
            return None
        return self._add_text(new_text)

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy (for a forked sequence / beam); the tokenizer is shared."""
        twin = object.__new__(IncrementalDetokenizer)
        twin.__dict__.update(self.__dict__)
        twin._window = list(self._window)
        twin._chunks = [self.text] if self._chunks else []
        return twin

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _next_text(self, token_id: int) -> str:
        """The text `token_id` adds, "" while it is waiting for more tokens."""
        self._window.append(token_id)
        window_text = self._decode(self._window)
        # Not longer: a skipped special token (or one the decoder merges away); ends in U+FFFD: an
        # incomplete character. Either way the offsets stay, so the next decode sees these tokens.
        if len(window_text) <= len(self._prefix_text) or window_text.endswith(REPLACEMENT_CHAR):
            return ""
        new_text = window_text[len(self._prefix_text) :]
        # prefix_offset := read_offset, read_offset := end.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new_text

    def _add_text(self, new_text: str) -> str | None:
        region = self._tail + new_text
        hit: tuple[int, int, str] | None = None
        for s in self._stop:
            # A match must end inside new_text: one wholly in older text would have stopped earlier.
            start = region.find(s, max(0, len(self._tail) - len(s) + 1))
            # Earliest start wins; at the same start the shorter string, which ended first.
            if start >= 0 and (hit is None or (start, start + len(s)) < hit[:2]):
                hit = (start, start + len(s), s)
        if hit is None:
            self._chunks.append(new_text)
            self._tail = region[max(0, len(region) - self._tail_len) :]
            return None
        start, end, s = hit
        cut = end if self._include_stop else start
        # `region` begins len(tail) characters before the end of the text so far.
        kept = self.text[: len(self.text) - len(self._tail)] + region[:cut]
        self._chunks = [kept] if kept else []
        self._stopped_by = s
        return s
