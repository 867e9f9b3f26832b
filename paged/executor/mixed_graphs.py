"""Steps with prompt tokens (prefill and mixed) replayed from CUDA graphs, keyed on padded shape.

An eager step of a 30-layer model costs tens of milliseconds of host, a step with prompt tokens as
much as a decode step; vLLM captures these too, keyed on the padded token count. Here a graph is
captured per `MixedShape` (padded tokens, decode rows, prefill rows) and decode kernel, the first
time a step needs it, with our prefill and decode kernels inside: `paged.executor.step_plan.
pad_mixed` pads the step so that no launch shape and no index count depends on the batch
(padding tokens at slot -1 write nothing; padding rows have no query or a one-token context), and
the kernels' grids are sized for the shape (the prefill grid for every prefill query row, the
decode grid for `max_model_len`). The decode/prefill split stays as the eager step's, so a
replay runs each row through the kernel the eager step would: the padded step is the eager one
bit for bit (`tests/test_mixed_graphs.py`, on the CPU backends; emu runs the CUDA sources).

Bounded memory: tokens pad to 8, 16, ..., 512, then multiples of 512 (`token_sizes`), rows to
powers of two (`row_sizes`); the graphs share the decode graphs' memory pool (they never replay at
once), and at most `MAX_GRAPHS` are captured: a shape past them, past the largest size, with KV
groups, or whose capture failed (logged) runs eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from paged.executor.cuda_graphs import Forward, GraphTable
from paged.executor.step_plan import BatchInput, HostBatch, InputBuffers, pad_mixed

log = logging.getLogger(__name__)

# Token sizes double up to this, then grow by it: past it a step's padding costs GPU time, not
# only launches, and multiples of it waste at most half of a step.
TOKEN_STEP = 512
MIN_TOKENS = 8
# Graphs captured at most: each keeps its hidden states and its kernel nodes, and costs a capture.
MAX_GRAPHS = 64


def token_sizes(max_tokens: int) -> list[int]:
    """8, 16, 32, ..., 512, then multiples of 512, until one holds `max_tokens`."""
    sizes = [MIN_TOKENS]
    while sizes[-1] < max_tokens:
        sizes.append(sizes[-1] * 2 if sizes[-1] < TOKEN_STEP else sizes[-1] + TOKEN_STEP)
    return sizes


def row_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, ..., until one holds `max_rows`."""
    sizes = [1]
    while sizes[-1] < max_rows:
        sizes.append(sizes[-1] * 2)
    return sizes


def _fit(n: int, sizes: list[int]) -> int | None:
    return next((s for s in sizes if s >= n), None)


@dataclass(frozen=True)
class MixedShape:
    """What a graph of a step with prompt tokens is captured for: `tokens` query rows in all,
    `decode_rows` of them decode rows (0: a prefill-only step), `prefill_rows` prefill sequences."""

    tokens: int
    decode_rows: int
    prefill_rows: int


class MixedShapes:
    """The shapes of steps of up to `max_num_batched_tokens` tokens and `max_num_seqs` sequences
    whose tables fit `table_width` columns."""

    def __init__(self, max_num_seqs: int, max_num_batched_tokens: int, table_width: int) -> None:
        self.rows = row_sizes(max_num_seqs)
        # a step's padding decode rows take a padding token each
        self.tokens = token_sizes(max_num_batched_tokens + self.rows[-1])
        self.table_width = table_width

    def of(self, batch: HostBatch) -> MixedShape | None:
        """The shape `batch` replays at; `None` when it has no prompt tokens, has KV groups, or
        fits no shape."""
        prefill, decode = batch.prefill, batch.decode
        if prefill is None or batch.groups:
            return None
        parts = [prefill] if decode is None else [prefill, decode]
        if any(rows.block_tables.shape[1] > self.table_width for rows in parts):
            return None
        decode_rows = 0 if decode is None else _fit(decode.num_seqs, self.rows)
        prefill_rows = _fit(prefill.num_seqs, self.rows)
        if decode_rows is None or prefill_rows is None:
            return None
        num_decode = 0 if decode is None else decode.num_seqs
        tokens = _fit(batch.num_tokens + decode_rows - num_decode, self.tokens)
        return None if tokens is None else MixedShape(tokens, decode_rows, prefill_rows)


class MixedGraphs:
    """Captures and replays `forward` for steps with prompt tokens (`MixedShapes`' limits), in
    `pool`; decode kernels run rows of up to `table_width * block_size` tokens."""

    def __init__(self, forward: Forward, device: torch.device, pool: tuple[int, int], max_num_seqs: int,
                 max_num_batched_tokens: int, table_width: int, block_size: int) -> None:
        self.shapes = MixedShapes(max_num_seqs, max_num_batched_tokens, table_width)
        self.max_seq_len = table_width * block_size
        most_tokens, most_rows = self.shapes.tokens[-1], 2 * self.shapes.rows[-1]
        # int64: ids, positions, slots, both ops' query indices, sample rows; int32: tables, lengths, offsets
        capacity = max(4 * most_tokens + most_rows, most_rows * (table_width + 2) + 2)
        self.buffers = InputBuffers(device, capacity=capacity, fixed=True)
        self.table = GraphTable(forward, device, pool, limit=MAX_GRAPHS)

    def run(self, batch: HostBatch, version: str | None) -> tuple[torch.Tensor, BatchInput] | None:
        """The hidden states of the batch's tokens and the inputs as the device holds them, from a
        replay; `None` when this batch runs eagerly."""
        shape = self.shapes.of(batch)
        if shape is None or not self.table.replays((shape, version)):
            return None
        inputs = self.buffers.upload(pad_mixed(batch, shape.tokens, shape.decode_rows, shape.prefill_rows,
                                               self.shapes.table_width, self.max_seq_len))
        graph = self.table.graph((shape, version), version, inputs, f"{shape} (decode kernel {version})")
        if graph is None:
            return None
        graph.graph.replay()
        return graph.hidden[: batch.num_tokens], inputs
