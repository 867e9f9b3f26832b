"""Decode steps replayed from CUDA graphs, one graph per padded batch size and decode kernel.

A decode step of a small model is hundreds of short kernels, and launching them from Python costs
more than running them; a CUDA graph launches them all at once. A graph replays fixed addresses
and shapes, so a decode batch of n rows is padded to the next capture size (1, 2, 4, 8, then
multiples of 8, as vLLM does), its inputs are written into fixed buffers, its block tables are as
wide as `max_model_len` needs, and the attention kernels are launched for the longest context
(`paged.executor.step_plan.pad_decode`): partitions past a row's length return at once, so the
output is the eager step's. A size is captured the first time a batch needs it, after one eager
warm-up run (which loads kernels and sets up cuBLAS outside the capture). Steps with prompt
tokens replay their own graphs (`paged.executor.mixed_graphs`); batches larger than the largest
size run eagerly; a capture that fails is logged and its size runs eagerly from then on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from paged.executor.step_plan import BatchInput, HostBatch, InputBuffers, pad_decode

log = logging.getLogger(__name__)

# vLLM's default largest capture size: past it a batch amortises its launches by itself.
MAX_CAPTURE_SIZE = 512

Forward = Callable[[BatchInput, str | None], torch.Tensor]
"""(inputs, decode kernel version or None without decode rows) -> hidden states `[tokens, hidden]`"""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, until one holds `max_num_seqs` rows (at most
    `MAX_CAPTURE_SIZE`)."""
    sizes: list[int] = []
    size = 1
    while size < min(max_num_seqs, MAX_CAPTURE_SIZE):
        sizes.append(size)
        size = size * 2 if size < 8 else size + 8
    return [*sizes, min(size, MAX_CAPTURE_SIZE)]


def padded_size(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest capture size that holds `num_rows`; `None` past the largest."""
    return next((s for s in sizes if s >= num_rows), None)


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # where each replay leaves the hidden states


def capture(forward: Forward, inputs: BatchInput, version: str | None, device: torch.device,
            pool: tuple[int, int]) -> Captured:
    """`forward` over `inputs` captured into `pool`, after one eager run on a side stream (which
    loads the kernels and sets cuBLAS up outside the capture); raises what the capture raised."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        forward(inputs, version)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        hidden = forward(inputs, version)
    return Captured(graph, hidden)


class GraphTable:
    """Graphs of `forward` captured into `pool` the first time a key needs one; a key whose capture
    failed (logged) runs eagerly from then on, as does a new key once `limit` graphs are held."""

    def __init__(self, forward: Forward, device: torch.device, pool: tuple[int, int], limit: int | None = None) -> None:
        self.forward, self.device, self.pool, self.limit = forward, device, pool, limit
        self.graphs: dict[Hashable, Captured] = {}
        self.failed: set[Hashable] = set()

    def replays(self, key: Hashable) -> bool:
        """Whether a step of `key` replays a graph (one held, or one it may capture)."""
        full = self.limit is not None and len(self.graphs) >= self.limit
        return key not in self.failed and (key in self.graphs or not full)

    def graph(self, key: Hashable, version: str | None, inputs: BatchInput, what: str) -> Captured | None:
        """`key`'s graph, captured now over `inputs` if it has none; None when the capture failed
        (`what` names the step in the log)."""
        if key in self.graphs:
            return self.graphs[key]
        try:
            captured = capture(self.forward, inputs, version, self.device, self.pool)
        except (RuntimeError, ValueError) as e:
            log.warning("capturing a CUDA graph for %s failed, so those steps run eagerly: %s", what, e)
            self.failed.add(key)
            return None
        self.graphs[key] = captured
        full = self.limit is not None and len(self.graphs) >= self.limit
        log.info("captured a CUDA graph for %s%s", what, "; later shapes run eagerly" if full else "")
        return captured


class DecodeGraphs:
    """Captures and replays `forward` for decode batches. `table_width` block-table columns and
    `max_seq_len` tokens bound the rows a graph takes."""

    def __init__(self, forward: Forward, device: torch.device, max_num_seqs: int, table_width: int,
                 block_size: int) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        self.table_width = table_width
        self.max_seq_len = table_width * block_size
        largest = self.sizes[-1]
        # per row: ids, positions, slots and a sample row (int64); a table row, a length, an offset (int32)
        self.buffers = InputBuffers(device, capacity=largest * (table_width + 4) + 1, fixed=True)
        self.pool = torch.cuda.graph_pool_handle()
        self.table = GraphTable(forward, device, self.pool)

    def replayable(self, batch: HostBatch) -> int | None:
        """The capture size this batch replays at; `None` when it must run eagerly."""
        rows = batch.decode
        if rows is None or batch.prefill is not None or rows.block_tables.shape[1] > self.table_width:
            return None
        return padded_size(rows.seq_lens.shape[0], self.sizes)

    def run(self, batch: HostBatch, version: str) -> tuple[torch.Tensor, BatchInput] | None:
        """The hidden states of the batch's rows and the inputs as the device holds them, from a
        replay; `None` when this batch runs eagerly."""
        size = self.replayable(batch)
        if size is None or not self.table.replays((size, version)):
            return None
        inputs = self.buffers.upload(pad_decode(batch, size, self.table_width, self.max_seq_len))
        graph = self.table.graph((size, version), version, inputs, f"{size} decode rows ({version})")
        if graph is None:
            return None
        graph.graph.replay()
        return graph.hidden[: batch.num_tokens], inputs
