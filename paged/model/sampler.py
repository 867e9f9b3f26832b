"""Token sampling as vLLM does it: penalties and min_tokens on the logits, then greedy, beam
candidates, or temperature / top-k / top-p / min-p sampling, with per-sequence seeds and the
log-probabilities a request asks for.

A draw keeps no generator state: its uniform number comes from a generator seeded by
(request seed + sequence index, number of output tokens so far). A sequence that is preempted and
recomputed therefore draws exactly the tokens it would have drawn without preemption, the tokens do
not depend on which other requests share the batch, and sample i of a request with seed s is the
single-sample run with seed s + i.

Reported log-probabilities are the model's raw ones (log-softmax of the logits before penalties,
temperature and filtering: vLLM V1's default `raw_logprobs`); beam candidates are ranked by the
log-softmax of the penalised logits, as HF's beam search ranks its processed scores.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from paged.request import SamplingParams
from paged.step import Samples, TokenLogprobs

_U64 = 2**64 - 1

@dataclass
class SampleRow:
    """One logits row to sample from. Sample j of the row is drawn for sequence `seq_index + j`,
    which is the index the scheduler gives the j-th sequence forked from it. A beam row
    (`params.use_beam_search`) returns its `num_samples` most likely tokens instead of draws."""

    params: SamplingParams
    seed: int
    seq_index: int = 0
    num_output_tokens: int = 0
    num_samples: int = 1
    # the sequence's tokens (prompt, then output) and its prompt length: what the penalties count
    token_ids: list[int] | None = None
    num_prompt_tokens: int = 0


def uniforms(row: SampleRow) -> np.ndarray:
    return np.array(
        [
            np.random.default_rng(((row.seed + row.seq_index + j) & _U64, row.num_output_tokens)).random()
            for j in range(row.num_samples)
        ]
    )


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow], eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """vLLM's order: repetition (prompt and output tokens), frequency and presence (output tokens),
    then min_tokens, which forbids EOS (unless ignore_eos) and `stop_token_ids` until the sequence
    has `min_tokens` output tokens. Returns `logits` itself when no row needs any of it."""
    out = logits
    for i, r in enumerate(rows):
        p = r.params
        min_tokens = r.num_output_tokens < p.min_tokens
        if not (min_tokens or _has_penalty(p)):
            continue
        if out is logits:
            out = logits.clone()
        row = out[i]
        tokens = r.token_ids or []
        output = torch.tensor(tokens[r.num_prompt_tokens :], dtype=torch.long, device=row.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(tokens, dtype=torch.long, device=row.device).unique()
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if output.numel() and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(output, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if min_tokens:
            banned = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
            if banned:
                row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")
    return out


def sample_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after temperature with top-k, top-p then min-p applied as zeroed columns, in
    vocabulary order and not renormalised: a row's probabilities, and so its draw, never depend on
    whether its batch neighbours filter."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    if any(p.min_p for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), 0.0)
    if all(p.top_k == 0 and p.top_p >= 1.0 for p in params):
        return probs
    vocab = probs.shape[1]
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    top_k = torch.tensor([p.top_k or vocab for p in params], device=probs.device)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=probs.device)
    in_top_k = torch.arange(vocab, device=probs.device) < top_k.unsqueeze(1)
    ranked = ranked.masked_fill(~in_top_k, 0.0)
    ranked = ranked / ranked.sum(dim=-1, keepdim=True)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
    keep = in_top_k & (ranked.cumsum(dim=-1) - ranked < top_p.unsqueeze(1))
    return probs.masked_fill(~torch.zeros_like(keep).scatter_(1, order, keep), 0.0)


def _choose(logits: torch.Tensor, rows: list[SampleRow]) -> list[list[int]]:
    """Token ids per row: beam rows their top `num_samples`, greedy rows one batched argmax, the
    others one batched inverse-CDF lookup."""
    out: list[list[int]] = [[] for _ in rows]
    beams = [i for i, r in enumerate(rows) if r.params.use_beam_search]
    if beams:
        width = max(rows[i].num_samples for i in beams)
        top = torch.log_softmax(logits[beams], dim=-1).topk(width, dim=-1).indices.tolist()
        for j, i in enumerate(beams):
            out[i] = top[j][: rows[i].num_samples]
    greedy = [i for i, r in enumerate(rows) if r.params.greedy and not r.params.use_beam_search]
    if greedy:
        best = logits[greedy].argmax(dim=-1).tolist()
        for j, i in enumerate(greedy):
            out[i] = [best[j]] * rows[i].num_samples
    rand = [i for i, r in enumerate(rows) if not r.params.greedy]
    if rand:
        cdf = sample_probs(logits[rand], [rows[i].params for i in rand]).double().cumsum(dim=-1)
        width = max(rows[i].num_samples for i in rand)
        u = np.zeros((len(rand), width))
        for j, i in enumerate(rand):
            u[j, : rows[i].num_samples] = uniforms(rows[i])
        targets = torch.from_numpy(u).to(cdf.device) * cdf[:, -1:]
        # First column whose cumulative mass exceeds the target: zero-probability columns never win.
        cols = torch.searchsorted(cdf, targets, right=True).clamp_(max=cdf.shape[1] - 1)
        ids = cols.tolist()
        for j, i in enumerate(rand):
            out[i] = ids[j][: rows[i].num_samples]
    return out


def top_logprobs(logprobs: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Per token of `token_ids` (all from this one distribution row): its own log-probability and
    rank, and the `k` most likely tokens with theirs."""
    top = logprobs.topk(k) if k else None
    shared: TokenLogprobs = {}
    if top is not None:
        shared = {t: (lp, rank) for rank, (lp, t) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1)}
    out = []
    for token in token_ids:
        own = logprobs[token]
        rank = int((logprobs > own).sum()) + 1
        out.append({token: (float(own), rank), **shared})
    return out


def _gathered_logprobs(logits: torch.Tensor, idx: torch.Tensor) -> list[list[float]]:
    """log_softmax(logits) at `idx`, without materialising the whole log-softmax."""
    return (logits.gather(1, idx) - torch.logsumexp(logits, dim=-1, keepdim=True)).tolist()


def sample(logits: torch.Tensor, rows: list[SampleRow], eos_token_ids: Collection[int] = ()) -> list[Samples]:
    """`Samples` per row from fp32 logits `[len(rows), vocab]`."""
    processed = apply_penalties(logits, rows, eos_token_ids)
    chosen = _choose(processed, rows)
    width = max(map(len, chosen))
    idx = torch.tensor([t + t[:1] * (width - len(t)) for t in chosen], device=logits.device)
    raw = _gathered_logprobs(logits, idx)
    # beam candidates carry the scores they were ranked by; sampled tokens the model's raw ones
    beams = any(r.params.use_beam_search for r in rows)
    ranked = _gathered_logprobs(processed, idx) if beams and processed is not logits else raw
    out = []
    for i, (r, tokens) in enumerate(zip(rows, chosen)):
        logprobs = (ranked if r.params.use_beam_search else raw)[i][: len(tokens)]
        k, top = r.params.logprobs, None
        if k is not None:
            row = torch.log_softmax(logits[i], dim=-1)
            top = top_logprobs(row, tokens, k)
            if not r.params.use_beam_search:  # the very values `top` reports
                logprobs = row[tokens].tolist()
        out.append(Samples(tokens, logprobs, top))
    return out
