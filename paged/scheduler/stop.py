"""The stop rules: whether the token a sequence just took ends it, and why (vLLM V1's `check_stop`
in `sched/utils.py`).

Before `min_tokens` output tokens only length can end a sequence (vLLM's order; the sampler bans
stop tokens until then too). From then on, in this order: one of the request's `stop_token_ids`
(the token is the stop reason), an EOS token unless `ignore_eos`, and a stop string that the
sequence's incremental detokenizer found (the string is the stop reason). Last comes length:
`max_tokens` output tokens, or `max_model_len` tokens in all.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from paged.detokenizer import IncrementalDetokenizer
from paged.request import FinishReason, Request, Sequence

Stop = tuple[FinishReason, int | str | None]  # (finish reason, stop reason)


def check_stop(seq: Sequence, token_id: int, eos_token_ids: Collection[int], max_model_len: int) -> Stop | None:
    """Whether `token_id`, just appended to `seq`, ends it: (finish reason, stop reason), or None.
    Feeds the token to the sequence's detokenizer, if it has one: it must see every token."""
    params = seq.request.params
    num_tokens = len(seq.token_ids)
    num_output = num_tokens - seq.num_prompt_tokens
    past_min = num_output >= params.min_tokens
    stop = seq.detokenizer.append(token_id, check_stop=past_min) if seq.detokenizer is not None else None
    if past_min:
        if token_id in params.stop_token_ids:
            return FinishReason.STOP, token_id
        if token_id in eos_token_ids and not params.ignore_eos:
            return FinishReason.STOP, None
        if stop is not None:
            return FinishReason.STOP, stop
    if num_output >= params.max_tokens or num_tokens >= max_model_len:
        return FinishReason.LENGTH, None
    return None


def watch_stop_strings(request: Request, tokenizer: Any) -> None:
    """Give each of `request`'s sequences an incremental detokenizer, which finds its stop strings
    as its output grows (a forked sequence takes a copy of its parent's)."""
    params = request.params
    for seq in request.seqs:
        seq.detokenizer = IncrementalDetokenizer(
            tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
            stop=params.stop_strings, include_stop_str_in_output=params.include_stop_str_in_output,
        )
