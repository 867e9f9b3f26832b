"""What rank 0 samples from a step's hidden states: each sampling row's settings and seed, and the
prompt log-probabilities a request asks for.

Seeds are per request: a request's own `seed`, else one derived from the experiment seed and the
request id, so unseeded requests still sample reproducibly, whatever batch they share a step with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch

from paged.model.sampler import SampleRow, top_logprobs
from paged.step import ScheduledSeq, SchedulerOutput, TokenLogprobs


def request_seed(item: ScheduledSeq, experiment_seed: int) -> int:
    seed = item.seq.request.params.seed
    if seed is not None:
        return seed
    key = f"{experiment_seed}:{item.seq.request.request_id}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def takes_argmax(sched: SchedulerOutput) -> bool:
    """Whether every row that samples this step takes its logits' argmax and nothing more
    (`SamplingParams.argmax_only`, with no `min_tokens` still to reach): the usual step, which is then
    sampled with one argmax and no `SampleRow` per row."""
    for it in sched.scheduled:
        if it.num_samples:
            seq = it.seq
            p = seq.request.params
            if not p.argmax_only or (p.min_tokens and len(seq.token_ids) - seq.num_prompt_tokens < p.min_tokens):
                return False
    return True


def sample_rows(sched: SchedulerOutput, experiment_seed: int) -> list[SampleRow]:
    """One row per scheduled sequence that samples this step, in batch order."""
    return [
        SampleRow(
            params=it.seq.request.params,
            seed=0 if it.seq.request.params.greedy else request_seed(it, experiment_seed),
            seq_index=it.seq.index,
            num_output_tokens=it.seq.num_output_tokens,
            num_samples=it.num_samples,
            token_ids=it.seq.token_ids,
            num_prompt_tokens=it.seq.num_prompt_tokens,
        )
        for it in sched.scheduled
        if it.num_samples > 0
    ]


def prompt_logprobs(
    sched: SchedulerOutput, hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> dict[int, list[TokenLogprobs | None]]:
    """Per sequence whose request asks for prompt_logprobs and whose prompt this step computes
    further (a whole prompt, or the next chunk of one): each newly covered prompt token's
    log-probability given the ones before it (None for the first); the scheduler joins chunks."""
    out: dict[int, list[TokenLogprobs | None]] = {}
    if not sched.is_prefill:
        return out
    offset = 0
    for it in sched.scheduled:
        request = it.seq.request
        k = request.params.prompt_logprobs
        start = it.num_computed
        # entries so far: None for token 0, then one per prompt token up to `start` (the row
        # before a token predicts it); a recomputed prompt's were all collected already
        collected = len(request.prompt_logprobs or ())
        if k is not None and collected == (start + 1 if start else 0) and collected < request.num_prompt_tokens:
            prompt = request.prompt_token_ids
            stop = min(start + it.num_new_tokens, len(prompt) - 1)  # rows j < stop predict token j + 1
            rows = hidden[offset : offset + stop - start]
            logprobs = torch.log_softmax(compute_logits(rows).float(), dim=-1)
            out[it.seq.seq_id] = [None] * (start == 0) + [
                top_logprobs(logprobs[j - start], [prompt[j + 1]], k)[0] for j in range(start, stop)
            ]
        offset += it.num_new_tokens
    return out
