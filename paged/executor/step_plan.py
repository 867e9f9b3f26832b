"""One step's model inputs: built once on the host, then copied to the device without waiting.

`plan_batch` turns a `SchedulerOutput` into numpy arrays (no per-token Python): token ids,
positions, cache slots, the rows to sample, and per attention op (decode rows with one new token,
prefill rows with more) the block tables, context lengths and query offsets, with their maxima
known on the host so no kernel has to ask the device for them. `InputBuffers.upload` packs them
into one int64 and one int32 buffer of page-locked host memory and copies each to the device with
one non-blocking copy (vLLM's persistent input batch); on a CPU the arrays are used as they are.
`pad_decode` widens a decode batch to a CUDA graph's shape, `pad_mixed` a batch with prompt tokens.

With KV groups per layer type (`paged.kv_layout`) each group has its own block tables
(`ScheduledSeq.group_tables`), so each has its own cache slots and attention rows; the rows'
lengths and query offsets are the same in every group. Group 0's are the batch's own fields, the
others' are `groups` (empty with one group, so a one-group step builds and uploads what it always did).
With KV compression (`kv_offsets`) a row's compressed groups (`compressed_groups`: the full-attention
ones) hold its context less the evicted tokens, at KV index = position less them; a windowed group
is never compressed and holds every position.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from paged.kernels.planned import Rows
from paged.step import SchedulerOutput


@dataclass(frozen=True)
class HostRows:
    """One attention op's sequences, on the host."""

    tokens: np.ndarray | None  # int64 flat indices of their query rows; None: all rows, in order
    block_tables: np.ndarray  # int32 [n, max_blocks], zero padded
    seq_lens: np.ndarray  # int32 [n]
    query_start_loc: np.ndarray  # int32 [n + 1]
    max_seq_len: int
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True)
class HostGroup:
    """A KV group's cache slots and attention rows, beyond group 0's (which are `HostBatch`'s own)."""

    slot_mapping: np.ndarray
    decode: HostRows | None
    prefill: HostRows | None


@dataclass(frozen=True)
class HostBatch:
    input_ids: np.ndarray  # int64 [T], all scheduled tokens, sequence after sequence
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [T]; -1: a padding row, written nowhere
    sample_rows: np.ndarray  # int64 [R], flat index of the last token of each sequence that samples
    decode: HostRows | None
    prefill: HostRows | None
    groups: tuple[HostGroup, ...] = ()  # KV groups 1.. (`paged.kv_layout`); empty with one group
    num_decode_tokens: int = 0  # rows that extend a generation by one token (`ScheduledSeq.is_decode`)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def _host_rows(picked: np.ndarray, num_new: np.ndarray, context: np.ndarray, tables: np.ndarray) -> HostRows | None:
    if not picked.any():
        return None
    q_lens, lens = num_new[picked], context[picked]
    return HostRows(
        tokens=None if picked.all() else np.flatnonzero(np.repeat(picked, num_new)),
        block_tables=np.ascontiguousarray(tables[picked]),
        seq_lens=lens.astype(np.int32),
        query_start_loc=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
        max_seq_len=int(lens.max()),
        max_query_len=int(q_lens.max()),
    )


_COMPUTED = operator.attrgetter("seq.num_computed_tokens")
_NUM_NEW = operator.attrgetter("num_new_tokens")
_NUM_SAMPLES = operator.attrgetter("num_samples")
_TABLE = operator.attrgetter("block_table")
_TOKENS = operator.attrgetter("seq.token_ids")
_PROMPT_LEN = operator.attrgetter("seq.num_prompt_tokens")


def plan_batch(sched: SchedulerOutput, block_size: int, num_groups: int = 1,
               compressed_groups: tuple[int, ...] = (0,)) -> HostBatch:
    """The step's inputs; with `num_groups` > 1 KV groups, every scheduled row carries its
    `group_tables` and each group gets its slots and rows; `sched.kv_offsets` apply to the groups
    `compressed_groups` (`KVLayout.full_groups`)."""
    items = sched.scheduled
    num_seqs = len(items)
    # attrgetters, not generators: this runs over every row of every step
    computed = np.fromiter(map(_COMPUTED, items), dtype=np.int64, count=num_seqs)
    num_new = np.fromiter(map(_NUM_NEW, items), dtype=np.int64, count=num_seqs)
    context = computed + num_new
    # KV compression (`paged.memory.compaction`): a row's KV index is its position less the tokens
    # evicted before it, and attention reads only the held ones
    offsets = None if sched.kv_offsets is None else np.asarray(sched.kv_offsets, dtype=np.int64)
    held = context if offsets is None else context - offsets
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
    decode = num_new == 1
    # `ScheduledSeq.is_decode` over the batch: one new token, after output tokens, the sequence's last
    num_tokens = np.fromiter(map(len, map(_TOKENS, items)), dtype=np.int64, count=num_seqs)
    prompt_lens = np.fromiter(map(_PROMPT_LEN, items), dtype=np.int64, count=num_seqs)
    extends = decode & (num_tokens > prompt_lens) & (context == num_tokens)

    slot_positions = positions if offsets is None else positions - offsets[owner]

    def group(block_tables: list[list[int]], g: int) -> HostGroup:
        compressed = offsets is not None and g in compressed_groups
        lens, at = (held, slot_positions) if compressed else (context, positions)
        table_lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_seqs)
        assert (table_lens * block_size >= lens).all(), "a block table is shorter than its context"
        tables = np.zeros((num_seqs, int(table_lens.max())), dtype=np.int32)
        # every table's entries in one pass, placed row-major by a mask: no numpy call per row
        entries = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(table_lens.sum()))
        tables[np.arange(tables.shape[1]) < table_lens[:, None]] = entries
        slots = tables[owner, at // block_size].astype(np.int64) * block_size + at % block_size
        return HostGroup(slots, _host_rows(decode, num_new, lens, tables), _host_rows(~decode, num_new, lens, tables))

    first = group(list(map(_TABLE, items)), 0)
    others: tuple[HostGroup, ...] = ()
    if num_groups > 1:
        missing = [it.seq.seq_id for it in items if it.group_tables is None or len(it.group_tables) != num_groups]
        assert not missing, f"sequences {missing} lack a block table for each of the {num_groups} KV groups"
        others = tuple(group([it.group_tables[g] for it in items], g) for g in range(1, num_groups))
    samples = np.fromiter(map(_NUM_SAMPLES, items), dtype=np.int64, count=num_seqs) > 0
    return HostBatch(
        input_ids=np.array(token_ids, dtype=np.int64),
        positions=positions,
        slot_mapping=first.slot_mapping,
        sample_rows=ends[samples] - 1,
        num_decode_tokens=int(extends.sum()),
        decode=first.decode,
        prefill=first.prefill,
        groups=others,
    )


def pad_decode(batch: HostBatch, size: int, width: int, max_seq_len: int) -> HostBatch:
    """A decode-only batch as a CUDA graph for `size` rows and `width` table columns replays it:
    padding rows read one token of block 0 (any block holds finite values) and write nowhere, and
    `max_seq_len` is the graph's, so the kernels' launch shapes do not depend on the batch."""
    rows = batch.decode
    assert rows is not None and batch.prefill is None, "only decode batches replay a graph"
    n = rows.seq_lens.shape[0]
    assert n <= size and rows.block_tables.shape[1] <= width and rows.max_seq_len <= max_seq_len

    def padded(a: np.ndarray, fill: int) -> np.ndarray:
        return np.concatenate([a, np.full(size - n, fill, dtype=a.dtype)])

    tables = np.zeros((size, width), dtype=np.int32)
    tables[:n, : rows.block_tables.shape[1]] = rows.block_tables
    return replace(
        batch, input_ids=padded(batch.input_ids, 0), positions=padded(batch.positions, 0),
        slot_mapping=padded(batch.slot_mapping, -1),
        decode=replace(rows, block_tables=tables, seq_lens=padded(rows.seq_lens, 1),
                       query_start_loc=np.arange(size + 1, dtype=np.int32), max_seq_len=max_seq_len),
    )


def pad_mixed(batch: HostBatch, tokens: int, decode_rows: int, prefill_rows: int, width: int,
              max_seq_len: int) -> HostBatch:
    """A batch with prompt tokens as a CUDA graph for `tokens` tokens, `decode_rows` decode rows
    and `prefill_rows` prefill rows replays it, so no launch shape or index count depends on the
    batch. The real tokens keep their places; padding tokens follow, at slot -1 (written nowhere),
    position 0. Padding decode rows are `pad_decode`'s (one token of block 0), each with a padding
    token for its query; the other padding tokens are query rows of the prefill op past its last
    offset, which its kernel never reads nor writes, and padding prefill rows hold no query and no
    context (the kernel returns at once). The prefill grid is sized for every prefill query row
    (`max_query_len`), the decode kernels for `max_seq_len`, as wide tables as `width` columns."""
    rows, prefill = batch.decode, batch.prefill
    assert prefill is not None and not batch.groups, "a mixed graph replays a one-group batch with prompt tokens"
    n, num_decode, num_prefill = batch.num_tokens, 0 if rows is None else rows.num_seqs, prefill.num_seqs
    assert (num_decode == 0) == (decode_rows == 0) and num_decode <= decode_rows and num_prefill <= prefill_rows
    assert n + decode_rows - num_decode <= tokens, f"{n} tokens and {decode_rows - num_decode} padding rows"
    assert max(prefill.max_seq_len, 0 if rows is None else rows.max_seq_len) <= max_seq_len

    def padded(a: np.ndarray, size: int, fill: int) -> np.ndarray:
        return np.concatenate([a, np.full(size - a.shape[0], fill, dtype=a.dtype)])

    def table(host: HostRows, size: int) -> np.ndarray:
        out = np.zeros((size, width), dtype=np.int32)
        out[: host.num_seqs, : host.block_tables.shape[1]] = host.block_tables
        return out

    spare = np.arange(n, tokens, dtype=np.int64)  # the padding tokens, in order
    decode = None
    if rows is not None:
        assert rows.tokens is not None
        decode = replace(rows, tokens=np.concatenate([rows.tokens, spare[: decode_rows - num_decode]]),
                         block_tables=table(rows, decode_rows), seq_lens=padded(rows.seq_lens, decode_rows, 1),
                         query_start_loc=np.arange(decode_rows + 1, dtype=np.int32), max_seq_len=max_seq_len)
    queries = np.arange(n, dtype=np.int64) if prefill.tokens is None else prefill.tokens
    prefill_tokens = None if rows is None else np.concatenate([queries, spare[decode_rows - num_decode :]])
    return replace(
        batch, input_ids=padded(batch.input_ids, tokens, 0), positions=padded(batch.positions, tokens, 0),
        slot_mapping=padded(batch.slot_mapping, tokens, -1), decode=decode,
        prefill=replace(prefill, tokens=prefill_tokens, block_tables=table(prefill, prefill_rows),
                        seq_lens=padded(prefill.seq_lens, prefill_rows, 0),
                        query_start_loc=padded(prefill.query_start_loc, prefill_rows + 1,
                                               int(prefill.query_start_loc[-1])),
                        max_seq_len=max_seq_len, max_query_len=tokens - decode_rows),
    )


@dataclass(frozen=True)
class GroupInput:
    """One KV group's side of a step on the device: where its new K/V go and the rows its attention
    ops read, with their host copies."""

    slot_mapping: torch.Tensor
    host_slot_mapping: np.ndarray
    decode: Rows | None
    prefill: Rows | None


@dataclass(frozen=True)
class BatchInput:
    """A `HostBatch` on the device; `decode` / `prefill` carry their host arrays too."""

    host: HostBatch
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    sample_rows: torch.Tensor
    decode: Rows | None
    decode_tokens: torch.Tensor | None
    prefill: Rows | None
    prefill_tokens: torch.Tensor | None
    other_groups: tuple[GroupInput, ...] = ()  # KV groups 1..

    @property
    def num_tokens(self) -> int:
        return self.host.num_tokens

    def group(self, index: int) -> GroupInput:
        """KV group `index`'s slots and rows (group 0's are the batch's own)."""
        if index == 0:
            return GroupInput(self.slot_mapping, self.host.slot_mapping, self.decode, self.prefill)
        return self.other_groups[index - 1]


class _Staging:
    """A device buffer of one dtype and its page-locked host mirror, filled array after array."""

    def __init__(self, dtype: torch.dtype, device: torch.device, capacity: int) -> None:
        self.dtype, self.device = dtype, device
        self.host = torch.empty(capacity, dtype=dtype, pin_memory=True)
        self.device_buffer = torch.empty(capacity, dtype=dtype, device=device)
        self.used = 0

    def add(self, array: np.ndarray) -> tuple[int, tuple[int, ...]]:
        start, n = self.used, array.size
        self.host.numpy()[start : start + n] = array.reshape(-1)
        self.used += n
        return start, array.shape

    def view(self, where: tuple[int, tuple[int, ...]]) -> torch.Tensor:
        start, shape = where
        return self.device_buffer[start : start + int(np.prod(shape))].view(shape)


class InputBuffers:
    """Where a step's inputs reach the device. On CUDA: one int64 and one int32 page-locked buffer
    and their device twins, each copied with one non-blocking copy per step; they grow (doubling)
    unless `fixed`, which a CUDA graph's buffers are, since a replay reads the addresses it was
    captured with. A step's host buffers are rewritten only once the previous step's copies ran."""

    def __init__(self, device: torch.device, capacity: int = 1 << 14, *, fixed: bool = False) -> None:
        self.device = device
        self.fixed = fixed
        self._copied: torch.cuda.Event | None = None
        self._wide = self._narrow = None
        if device.type == "cuda":
            self._wide = _Staging(torch.int64, device, capacity)
            self._narrow = _Staging(torch.int32, device, capacity)

    def upload(self, batch: HostBatch) -> BatchInput:
        if self.device.type != "cuda":
            return _wrap(batch, torch.from_numpy)
        if self._copied is not None:
            self._copied.synchronize()
        wide, narrow = self._fit(batch)
        wide.used = narrow.used = 0
        where = {id(a): (wide if a.dtype == np.int64 else narrow).add(a) for a in _arrays(batch)}
        for staging in (wide, narrow):
            staging.device_buffer[: staging.used].copy_(staging.host[: staging.used], non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return _wrap(batch, lambda a: (wide if a.dtype == np.int64 else narrow).view(where[id(a)]))

    def _fit(self, batch: HostBatch) -> tuple[_Staging, _Staging]:
        assert self._wide is not None and self._narrow is not None
        arrays = _arrays(batch)
        for name, dtype in (("_wide", np.int64), ("_narrow", np.int32)):
            staging: _Staging = getattr(self, name)
            needed = sum(a.size for a in arrays if a.dtype == dtype)
            if needed > staging.host.shape[0]:
                if self.fixed:
                    raise ValueError(f"a batch of {needed} {dtype.__name__} inputs exceeds fixed buffers of "
                                     f"{staging.host.shape[0]}")
                setattr(self, name, _Staging(staging.dtype, self.device, max(needed, 2 * staging.host.shape[0])))
        return self._wide, self._narrow


def _arrays(batch: HostBatch) -> list[np.ndarray]:
    """In a fixed order, the rows to sample last: a padded decode batch then packs every array a
    CUDA graph reads at the same offsets, however many of its rows sample."""
    arrays = [batch.input_ids, batch.positions, batch.slot_mapping]
    for rows in (batch.decode, batch.prefill):
        if rows is not None:
            arrays += [rows.block_tables, rows.seq_lens, rows.query_start_loc]
            if rows.tokens is not None:
                arrays.append(rows.tokens)
    for group in batch.groups:
        arrays.append(group.slot_mapping)
        arrays += [a for rows in (group.decode, group.prefill) if rows is not None
                   for a in (rows.block_tables, rows.seq_lens, rows.query_start_loc)]
    arrays.append(batch.sample_rows)
    for a in arrays:
        assert a.dtype in (np.int64, np.int32), a.dtype
    return arrays


def _wrap(batch: HostBatch, put: Callable[[np.ndarray], torch.Tensor]) -> BatchInput:
    def rows(host: HostRows | None) -> Rows | None:
        if host is None:
            return None
        return Rows(put(host.block_tables), put(host.seq_lens), put(host.query_start_loc), host.block_tables,
                    host.seq_lens, host.query_start_loc, host.max_seq_len, host.max_query_len)

    def tokens(host: HostRows | None) -> torch.Tensor | None:
        return None if host is None or host.tokens is None else put(host.tokens)

    others = tuple(GroupInput(put(g.slot_mapping), g.slot_mapping, rows(g.decode), rows(g.prefill))
                   for g in batch.groups)
    return BatchInput(
        batch, put(batch.input_ids), put(batch.positions), put(batch.slot_mapping), put(batch.sample_rows),
        rows(batch.decode), tokens(batch.decode), rows(batch.prefill), tokens(batch.prefill), others,
    )
