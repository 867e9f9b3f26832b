"""One step's model inputs, and attention through the paged KV cache.

`prepare_batch` turns a `SchedulerOutput` into flat tensors with numpy (no per-token Python), and
`PagedAttention` is the per-layer callback the model calls: it writes the step's new K/V into the
cache, then reads the context back through the block tables. Prefill reads each sequence's whole
context from the cache, so tokens a prefix-cache hit already holds are never recomputed; decode
runs the `paged_attention` kernel (v1 or v2).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from paged import kernels
from paged.scheduler.output import SchedulerOutput


@dataclass
class BatchInput:
    input_ids: torch.Tensor  # int64 [T], all scheduled tokens, sequence after sequence
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [S, max_blocks], zero padded
    seq_lens: torch.Tensor  # int32 [S], context length after this step
    query_starts: list[int]  # S + 1 offsets of each sequence's tokens in the flat batch
    context_lens: list[int]
    max_seq_len: int
    is_decode: bool  # every sequence runs exactly one new token
    sample_rows: torch.Tensor  # int64 [R], flat index of the last token of each sequence that samples

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]


def prepare_batch(sched: SchedulerOutput, block_size: int, device: torch.device) -> BatchInput:
    items = sched.scheduled
    num_seqs = len(items)
    computed = np.fromiter((it.seq.num_computed_tokens for it in items), dtype=np.int64, count=num_seqs)
    num_new = np.fromiter((it.num_new_tokens for it in items), dtype=np.int64, count=num_seqs)
    context = computed + num_new
    ends = np.cumsum(num_new)
    is_decode = bool((num_new == 1).all())
    if is_decode:
        token_ids = [it.seq.token_ids[c] for it, c in zip(items, computed.tolist(), strict=True)]
        positions = computed
        owner = np.arange(num_seqs)
    else:
        token_ids = list(
            itertools.chain.from_iterable(
                it.seq.token_ids[c : c + n] for it, c, n in zip(items, computed.tolist(), num_new.tolist(), strict=True)
            )
        )
        owner = np.repeat(np.arange(num_seqs), num_new)
        positions = np.arange(int(ends[-1])) - np.repeat(ends - num_new, num_new) + computed[owner]
    table_lens = np.fromiter((len(it.block_table) for it in items), dtype=np.int64, count=num_seqs)
    assert (table_lens * block_size >= context).all(), "a block table is shorter than its context"
    tables = np.zeros((num_seqs, int(table_lens.max())), dtype=np.int32)
    for row, it in zip(tables, items, strict=True):
        row[: len(it.block_table)] = it.block_table
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    samples = [i for i, it in enumerate(items) if it.num_samples > 0]
    return BatchInput(
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=torch.from_numpy(positions).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        block_tables=torch.from_numpy(tables).to(device),
        seq_lens=torch.from_numpy(context.astype(np.int32)).to(device),
        query_starts=[0, *ends.tolist()],
        context_lens=context.tolist(),
        max_seq_len=int(context.max()),
        is_decode=is_decode,
        sample_rows=torch.from_numpy(ends[samples] - 1).to(device),
    )


class PagedAttention:
    """The model's attention callback for one step: `(layer, q, k, v) -> out`. `version` (v1/v2)
    picks the decode kernel; a prefill batch has none."""

    def __init__(
        self,
        batch: BatchInput,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        scale: float,
        *,
        version: str | None,
        backend: str,
        partition_size: int,
    ) -> None:
        self.batch = batch
        self.key_caches = key_caches
        self.value_caches = value_caches
        self.scale = scale
        self.version = version
        self.backend = backend
        self.partition_size = partition_size

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        key_cache, value_cache = self.key_caches[layer], self.value_caches[layer]
        kernels.reshape_and_cache(k, v, key_cache, value_cache, b.slot_mapping, backend=self.backend)
        if self.version is not None:
            return kernels.paged_attention(
                q, key_cache, value_cache, b.block_tables, b.seq_lens, self.scale,
                version=self.version, backend=self.backend, partition_size=self.partition_size,
                max_seq_len=b.max_seq_len,
            )
        out = torch.empty_like(q)
        for i, context_len in enumerate(b.context_lens):
            start, end = b.query_starts[i], b.query_starts[i + 1]
            keys, values = kernels.gather_kv(key_cache, value_cache, b.block_tables[i], context_len)
            out[start:end] = kernels.prefill_attention(q[start:end], keys, values, self.scale)
        return out
