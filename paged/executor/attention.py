"""One step's model inputs, and attention through the paged KV cache.

`prepare_batch` turns a `SchedulerOutput` into flat tensors with numpy (no per-token Python), and
`PagedAttention` is the per-layer callback the model calls: it writes the step's new K/V into the
cache, then reads the context back through the block tables. A step may mix decode rows (one new
token) and prefill rows (several, possibly after cached ones): decode rows run the
`paged_attention` kernel (v1 or v2), prefill rows `prefill_attention`, one call each, so tokens a
prefix-cache hit already holds are never recomputed. With a sliding window both ops attend only the
last `sliding_window` positions, and never read the blocks wholly before them (the block manager
may have freed those).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from paged import kernels
from paged.executor.kv_scales import KVScales
from paged.kernels.backends.interface import KernelBackend
from paged.kernels.features import BlockSparse
from paged.step import SchedulerOutput


@dataclass
class AttentionRows:
    """The sequences of a step that one attention op runs: the decode rows or the prefill rows."""

    tokens: torch.Tensor | None  # int64 flat indices of their query rows; None: all rows, in order
    block_tables: torch.Tensor  # int32 [n, max_blocks], zero padded
    seq_lens: torch.Tensor  # int32 [n], context length after this step
    query_start_loc: torch.Tensor  # int32 [n + 1], offsets of each sequence's rows within `tokens`
    max_seq_len: int
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass
class BatchInput:
    input_ids: torch.Tensor  # int64 [T], all scheduled tokens, sequence after sequence
    positions: torch.Tensor  # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    sample_rows: torch.Tensor  # int64 [R], flat index of the last token of each sequence that samples
    num_tokens: int
    decode: AttentionRows | None  # sequences with one new token
    prefill: AttentionRows | None  # sequences with more

    @property
    def is_decode(self) -> bool:
        return self.prefill is None


def _rows(
    picked: np.ndarray, num_new: np.ndarray, context: np.ndarray, tables: np.ndarray, device: torch.device
) -> AttentionRows | None:
    """The `AttentionRows` of the sequences `picked` (a boolean mask over the batch)."""
    if not picked.any():
        return None
    q_lens, lens = num_new[picked], context[picked]
    tokens = None if picked.all() else torch.from_numpy(np.flatnonzero(np.repeat(picked, num_new))).to(device)
    return AttentionRows(
        tokens=tokens,
        block_tables=torch.from_numpy(tables[picked]).to(device),
        seq_lens=torch.from_numpy(lens.astype(np.int32)).to(device),
        query_start_loc=torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)).to(device),
        max_seq_len=int(lens.max()),
        max_query_len=int(q_lens.max()),
    )


def prepare_batch(sched: SchedulerOutput, block_size: int, device: torch.device) -> BatchInput:
    items = sched.scheduled
    num_seqs = len(items)
    computed = np.fromiter((it.seq.num_computed_tokens for it in items), dtype=np.int64, count=num_seqs)
    num_new = np.fromiter((it.num_new_tokens for it in items), dtype=np.int64, count=num_seqs)
    context = computed + num_new
    ends = np.cumsum(num_new)
    starts = ends - num_new
    if bool((num_new == 1).all()):
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
        positions = np.arange(int(ends[-1])) - starts[owner] + computed[owner]
    table_lens = np.fromiter((len(it.block_table) for it in items), dtype=np.int64, count=num_seqs)
    assert (table_lens * block_size >= context).all(), "a block table is shorter than its context"
    tables = np.zeros((num_seqs, int(table_lens.max())), dtype=np.int32)
    for row, it in zip(tables, items, strict=True):
        row[: len(it.block_table)] = it.block_table
    slots = tables[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    samples = [i for i, it in enumerate(items) if it.num_samples > 0]
    decode = num_new == 1
    return BatchInput(
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=torch.from_numpy(positions).to(device),
        slot_mapping=torch.from_numpy(slots).to(device),
        sample_rows=torch.from_numpy(ends[samples] - 1).to(device),
        num_tokens=int(ends[-1]),
        decode=_rows(decode, num_new, context, tables, device),
        prefill=_rows(~decode, num_new, context, tables, device),
    )


class PagedAttention:
    """The model's attention callback for one step: `(layer, q, k, v) -> out`, rows in batch order.
    `decode_version` (v1/v2) is the kernel the decode rows run, `None` when the step has none;
    `sliding_window` the attention window in tokens, `None` for the whole context; `kv_scales`
    the fp8 cache's scales (`None` for a cache in the model's dtype); `alibi_slopes` and
    `blocksparse` as in `paged.kernels.features`."""

    def __init__(
        self,
        batch: BatchInput,
        key_caches: list[torch.Tensor],
        value_caches: list[torch.Tensor],
        scale: float,
        *,
        decode_version: str | None,
        backend: str | KernelBackend,
        partition_size: int,
        sliding_window: int | None = None,
        kv_scales: KVScales | None = None,
        alibi_slopes: torch.Tensor | None = None,
        blocksparse: BlockSparse | None = None,
    ) -> None:
        assert (decode_version is None) == (batch.decode is None), "decode rows need a version, and only they"
        self.batch = batch
        self.key_caches = key_caches
        self.value_caches = value_caches
        self.scale = scale
        self.decode_version = decode_version
        self.backend = kernels.get_backend(backend)
        self.partition_size = partition_size
        self.sliding_window = sliding_window
        self.kv_scales = kv_scales
        # what both attention ops take besides the rows and the cache's scales
        self.options = {"sliding_window": sliding_window, "alibi_slopes": alibi_slopes, "blocksparse": blocksparse}

    def _decode(self, rows: AttentionRows, q: torch.Tensor, caches: tuple[torch.Tensor, ...],
                scales: dict[str, torch.Tensor]) -> torch.Tensor:
        assert self.decode_version is not None
        return kernels.paged_attention(
            q, *caches, rows.block_tables, rows.seq_lens, self.scale, version=self.decode_version, backend=self.backend,
            partition_size=self.partition_size, max_seq_len=rows.max_seq_len, **self.options, **scales,
        )

    def _prefill(self, rows: AttentionRows, q: torch.Tensor, caches: tuple[torch.Tensor, ...],
                 scales: dict[str, torch.Tensor]) -> torch.Tensor:
        return kernels.prefill_attention(
            q, *caches, rows.block_tables, rows.query_start_loc, rows.seq_lens, self.scale, backend=self.backend,
            max_query_len=rows.max_query_len, max_seq_len=rows.max_seq_len, **self.options, **scales,
        )

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        caches = self.key_caches[layer], self.value_caches[layer]
        scales: dict[str, torch.Tensor] = {}
        if self.kv_scales is not None:
            scales = dict(zip(("k_scale", "v_scale"), self.kv_scales.for_layer(layer, k, v)))
        kernels.reshape_and_cache(k, v, *caches, b.slot_mapping, backend=self.backend, **scales)
        if b.prefill is None:
            return self._decode(b.decode, q, caches, scales)
        if b.decode is None:
            return self._prefill(b.prefill, q, caches, scales)
        out = torch.empty_like(q)
        out[b.decode.tokens] = self._decode(b.decode, q[b.decode.tokens], caches, scales)
        out[b.prefill.tokens] = self._prefill(b.prefill, q[b.prefill.tokens], caches, scales)
        return out
