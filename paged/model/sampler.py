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
log-softmax of the penalised logits, as HF's beam search ranks its processed scores. Only rows that
`scores_tokens` compute them; the others report 0.0 placeholders.

A step reads the device once: every token is chosen on the device into one tensor, and the tokens,
with the log-probabilities of the rows that want them, come back to the host in one copy. A read is
a synchronisation on a GPU, so each one more would stall the step until the device caught up.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from paged.kernels.transfer import to_device
from paged.request import SamplingParams
from paged.step import Samples, TokenLogprobs, scores_tokens

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


def _on(values: list[int] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a `dtype` tensor on `device`, through pinned memory: `torch.tensor(values,
    device=cuda)` copies from pageable memory, which makes the host wait for the device."""
    return to_device(np.asarray(values, dtype=np.float64 if dtype.is_floating_point else np.int64), device).to(dtype)


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
        output = _on(tokens[r.num_prompt_tokens :], torch.long, row.device)
        if p.repetition_penalty != 1.0:
            # deduplicated on the host: a device `unique` reads its result size back (a sync)
            seen = _on(sorted(set(tokens)), torch.long, row.device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if output.numel() and (p.frequency_penalty or p.presence_penalty):
            # counted by index_add_, not bincount, which reads the largest id back to size its output
            ones = torch.ones(output.shape, dtype=row.dtype, device=row.device)
            counts = torch.zeros_like(row).index_add_(0, output, ones)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if min_tokens:
            banned = [*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]
            if banned:
                row[_on(banned, torch.long, row.device)] = float("-inf")
    return out


def sample_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after temperature with top-k, top-p then min-p applied as zeroed columns, in
    vocabulary order and not renormalised: a row's probabilities, and so its draw, never depend on
    whether its batch neighbours filter."""
    temps = _on([p.temperature for p in params], logits.dtype, logits.device)
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    if any(p.min_p for p in params):
        min_p = _on([p.min_p for p in params], probs.dtype, probs.device)
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), 0.0)
    if all(p.top_k == 0 and p.top_p >= 1.0 for p in params):
        return probs
    vocab = probs.shape[1]
    ranked, order = probs.sort(dim=-1, descending=True, stable=True)
    top_k = _on([p.top_k or vocab for p in params], torch.long, probs.device)
    top_p = _on([p.top_p for p in params], probs.dtype, probs.device)
    in_top_k = torch.arange(vocab, device=probs.device) < top_k.unsqueeze(1)
    ranked = ranked.masked_fill(~in_top_k, 0.0)
    ranked = ranked / ranked.sum(dim=-1, keepdim=True)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does.
    keep = in_top_k & (ranked.cumsum(dim=-1) - ranked < top_p.unsqueeze(1))
    return probs.masked_fill(~torch.zeros_like(keep).scatter_(1, order, keep), 0.0)


def _choose(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Token ids `[len(rows), widest num_samples]`, on the device: beam rows their top
    `num_samples`, greedy rows one batched argmax, the others one batched inverse-CDF lookup. A row's
    columns past its `num_samples` hold valid ids that mean nothing."""
    out = torch.zeros((len(rows), max(r.num_samples for r in rows)), dtype=torch.long, device=logits.device)
    beams = [i for i, r in enumerate(rows) if r.params.use_beam_search]
    if beams:
        width = max(rows[i].num_samples for i in beams)
        picked = _on(beams, torch.long, logits.device)
        out[picked, :width] = torch.log_softmax(logits[picked], dim=-1).topk(width, dim=-1).indices
    greedy = [i for i, r in enumerate(rows) if r.params.greedy and not r.params.use_beam_search]
    if len(greedy) == len(rows):  # the usual batch: no row index to copy to the device
        out[:] = logits.argmax(dim=-1, keepdim=True)
    elif greedy:
        picked = _on(greedy, torch.long, logits.device)
        out[picked] = logits[picked].argmax(dim=-1, keepdim=True)  # every sample of a greedy row alike
    rand = [i for i, r in enumerate(rows) if not r.params.greedy]
    if rand:
        picked = _on(rand, torch.long, logits.device)
        cdf = sample_probs(logits[picked], [rows[i].params for i in rand]).double().cumsum(dim=-1)
        width = max(rows[i].num_samples for i in rand)
        u = np.zeros((len(rand), width))
        for j, i in enumerate(rand):
            u[j, : rows[i].num_samples] = uniforms(rows[i])
        targets = to_device(u, cdf.device) * cdf[:, -1:]
        # First column whose cumulative mass exceeds the target: zero-probability columns never win.
        out[picked, :width] = torch.searchsorted(cdf, targets, right=True).clamp_(max=cdf.shape[1] - 1)
    return out


def _entries(
    token_ids: list[int], own: list[float], ranks: list[int], top_values: list[float], top_ids: list[int]
) -> list[TokenLogprobs]:
    """Per token its own log-probability and rank, then the top ones (ranked by position), which
    replace the token's own entry when it is among them."""
    shared = {t: (lp, rank) for rank, (lp, t) in enumerate(zip(top_values, top_ids), 1)}
    return [{token: (lp, rank), **shared} for token, lp, rank in zip(token_ids, own, ranks)]


def top_logprobs(logprobs: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprobs]:
    """Per token of `token_ids` (all from this one distribution row): its own log-probability and
    rank, and the `k` most likely tokens with theirs."""
    top = logprobs.topk(k) if k else None
    own = [logprobs[token] for token in token_ids]
    return _entries(
        token_ids, [float(lp) for lp in own], [int((logprobs > lp).sum()) + 1 for lp in own],
        top.values.tolist() if top is not None else [], top.indices.tolist() if top is not None else [],
    )


def _gathered_logprobs(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits) at `idx`, without materialising the whole log-softmax."""
    return logits.gather(1, idx) - torch.logsumexp(logits, dim=-1, keepdim=True)


def _read(parts: list[torch.Tensor]) -> list[list[list[float]]]:
    """2-D tensors to host lists in one device-to-host copy, as float64: that holds float32 values
    and integer ids or ranks (below 2**53) exactly."""
    flat = torch.cat([part.double().flatten() for part in parts]).tolist()
    out, start = [], 0
    for part in parts:
        rows, cols = part.shape
        out.append([flat[start + j * cols : start + (j + 1) * cols] for j in range(rows)])
        start += rows * cols
    return out


def _scored(
    logits: torch.Tensor, processed: torch.Tensor, chosen: torch.Tensor, rows: list[SampleRow], scored: list[int]
) -> list[Samples]:
    """`sample` when rows `scored` want log-probabilities: beam candidates the scores they were
    ranked by, sampled tokens the model's raw ones, and for rows asking `params.logprobs=k` each
    token's rank and the top k; all computed on the device and read with the tokens in one copy."""
    beams = [i for i in scored if rows[i].params.use_beam_search]
    # sampled rows that only their group ranks by (best_of > n): no top-k, no ranks
    ranked = [i for i in scored if not rows[i].params.use_beam_search and rows[i].params.logprobs is None]
    asking = [i for i in scored if rows[i].params.logprobs is not None]
    logprobs = torch.zeros(chosen.shape, dtype=torch.float64, device=chosen.device)
    if beams:
        logprobs[beams] = _gathered_logprobs(processed[beams], chosen[beams]).double()
    if ranked:
        logprobs[ranked] = _gathered_logprobs(logits[ranked], chosen[ranked]).double()
    parts = [chosen, logprobs]
    by_k: dict[int, list[int]] = {}  # k -> positions in `asking` of the rows asking for the top k
    if asking:
        full = torch.log_softmax(logits[asking], dim=-1)
        own = full.gather(1, chosen[asking])
        plain = [j for j, i in enumerate(asking) if not rows[i].params.use_beam_search]
        if plain:  # a sampled token reports the very value its entry shows
            logprobs[[asking[j] for j in plain]] = own[plain].double()
        width = max(rows[i].num_samples for i in asking)
        ranks = torch.stack([(full > own[:, c : c + 1]).sum(dim=-1) + 1 for c in range(width)], dim=1)
        parts += [own, ranks]
        for j, i in enumerate(asking):
            if k := rows[i].params.logprobs:
                by_k.setdefault(k, []).append(j)
        for k, positions in by_k.items():  # topk(k) per distinct k: ties order as for the row alone
            top = full[positions].topk(k, dim=-1)
            parts += [top.values, top.indices]
    ids, values, *rest = _read(parts)  # the step's one device-to-host read
    tokens = [[int(t) for t in row[: r.num_samples]] for r, row in zip(rows, ids)]
    tops: dict[int, list[TokenLogprobs]] = {}
    if asking:
        own_values, own_ranks, *top_parts = rest
        top: dict[int, tuple[list[float], list[int]]] = {}
        for positions, top_values, top_ids in zip(by_k.values(), top_parts[::2], top_parts[1::2]):
            for j, v, t in zip(positions, top_values, top_ids):
                top[j] = (v, [int(x) for x in t])
        for j, i in enumerate(asking):
            num = rows[i].num_samples
            ranks_j = [int(r) for r in own_ranks[j][:num]]
            tops[i] = _entries(tokens[i], own_values[j][:num], ranks_j, *top.get(j, ([], [])))
    return [Samples(tokens[i], values[i][: r.num_samples], tops.get(i)) for i, r in enumerate(rows)]


def choose(logits: torch.Tensor, rows: list[SampleRow], eos_token_ids: Collection[int] = ()) -> torch.Tensor:
    """The token ids `sample` would return, left on the device `[len(rows), widest num_samples]`,
    for rows that want no log-probabilities: async scheduling reads them a step later."""
    return _choose(apply_penalties(logits, rows, eos_token_ids), rows)


def sample(logits: torch.Tensor, rows: list[SampleRow], eos_token_ids: Collection[int] = ()) -> list[Samples]:
    """`Samples` per row from fp32 logits `[len(rows), vocab]`; a row that `scores_tokens` does not
    cover gets 0.0 for each token's log-probability."""
    processed = apply_penalties(logits, rows, eos_token_ids)
    chosen = _choose(processed, rows)
    scored = [i for i, r in enumerate(rows) if scores_tokens(r.params)]
    if scored:
        return _scored(logits, processed, chosen, rows, scored)
    return [
        Samples(tokens[: r.num_samples], [0.0] * r.num_samples)
        for r, tokens in zip(rows, chosen.tolist())  # the step's one device-to-host read
    ]
