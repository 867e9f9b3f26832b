"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

A draw keeps no generator state: its uniform numbers come from a generator seeded by
(seed, sequence index, number of output tokens so far). A sequence that is preempted and
recomputed therefore draws exactly the tokens it would have drawn without preemption, and the
tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged.request import SamplingParams

_U64 = 2**64 - 1


@dataclass
class SampleRow:
    """One logits row to sample from. Sample j of the row is drawn for sequence `seq_index + j`,
    which is the index the engine gives the j-th of n forked sequences."""

    params: SamplingParams
    seed: int
    seq_index: int = 0
    num_output_tokens: int = 0
    num_samples: int = 1


def uniforms(row: SampleRow) -> np.ndarray:
    return np.array(
        [
            np.random.default_rng((row.seed & _U64, row.seq_index + j, row.num_output_tokens)).random()
            for j in range(row.num_samples)
        ]
    )


def sample_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after temperature with top-k then top-p applied as zeroed columns, in vocabulary
    order and not renormalised: a row's probabilities, and so its draw, never depend on whether
    its batch neighbours filter."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=logits.device)
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
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


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> list[list[int]]:
    """Token ids per row (`num_samples` of them) from fp32 logits `[len(rows), vocab]`; greedy rows
    take one batched argmax, the others one batched inverse-CDF lookup."""
    out: list[list[int]] = [[] for _ in rows]
    if any(r.params.greedy for r in rows):
        best = logits.argmax(dim=-1).tolist()
        for i, r in enumerate(rows):
            if r.params.greedy:
                out[i] = [best[i]] * r.num_samples
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
