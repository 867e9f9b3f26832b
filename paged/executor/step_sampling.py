"""A step's tokens from its hidden states: read to the host (`sample_step`), or left on the device
for the next step's inputs under async scheduling (`sample_on_device`). The usual step, whose every
row takes its logits' argmax (`takes_argmax`), is one argmax with no per-row sampling work."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch

from paged.executor.sample_inputs import sample_rows, takes_argmax
from paged.executor.step_plan import BatchInput
from paged.kernels.greedy import argmax_rows
from paged.model.sampler import choose, sample
from paged.step import ExecutorOutput, SchedulerOutput


def sampled_logits(model: Any, hidden: torch.Tensor, batch: BatchInput) -> torch.Tensor:
    """The logits of the rows that sample; index_select, not hidden[rows]: advanced indexing costs
    ~7x its host time on a CPU. As many as the hidden rows (a decode step whose rows all sample)
    are all of them, in order (they are increasing): no copy then."""
    if batch.sample_rows.shape[0] == hidden.shape[0]:
        return model.compute_logits(hidden)
    return model.compute_logits(hidden.index_select(0, batch.sample_rows))


def sample_step(model: Any, sched: SchedulerOutput, hidden: torch.Tensor, batch: BatchInput, seed: int,
                eos_token_ids: Collection[int], argmax: bool = False) -> ExecutorOutput:
    """Each scheduled row's tokens (none for a row that samples nothing) on the host, with the
    log-probabilities its request asks for. `argmax`: every row is known to take its logits'
    argmax (`PersistentBatch.argmax`), else `takes_argmax` is asked."""
    num_rows = batch.sample_rows.shape[0]
    if not num_rows:
        return ExecutorOutput([[] for _ in sched.scheduled])
    logits = sampled_logits(model, hidden, batch)
    if argmax or takes_argmax(sched):
        if num_rows == len(sched.scheduled):  # every row samples: its one token a list already
            return ExecutorOutput(argmax_rows(logits).tolist())  # the step's one device-to-host read
        drawn = iter(argmax_rows(logits)[:, 0].tolist())
        return ExecutorOutput([[next(drawn)] if it.num_samples else [] for it in sched.scheduled])
    drawn = iter(sample(logits, sample_rows(sched, seed), eos_token_ids))
    per_seq = [next(drawn) if s.num_samples > 0 else None for s in sched.scheduled]
    return ExecutorOutput(
        [d.token_ids if d else [] for d in per_seq],
        logprobs=[d.logprobs if d else [] for d in per_seq],
        top_logprobs=[d.top_logprobs if d else None for d in per_seq],
    )


def sample_on_device(model: Any, sched: SchedulerOutput, hidden: torch.Tensor, batch: BatchInput, seed: int,
                     eos_token_ids: Collection[int]) -> torch.Tensor:
    """One token per sampling row, on the device (async scheduling: every row samples one token and
    asks for no log-probabilities, `paged.step.tokens_can_lag`)."""
    if not batch.sample_rows.shape[0]:
        return torch.empty(0, dtype=torch.long, device=hidden.device)
    logits = sampled_logits(model, hidden, batch)
    if takes_argmax(sched):
        return logits.argmax(dim=-1)
    return choose(logits, sample_rows(sched, seed), eos_token_ids)[:, 0]
