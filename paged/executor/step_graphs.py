"""How a step runs on the device: replayed from a CUDA graph (`DecodeGraphs` for decode steps,
`MixedGraphs` for steps with prompt tokens) or, where none replays it, eagerly; and summary.json's
count of each (`cuda_graph_steps`, `eager_decode_steps`, `eager_mixed_steps`)."""

from __future__ import annotations

import torch

from paged.executor.cuda_graphs import DecodeGraphs, Forward
from paged.executor.mixed_graphs import MixedGraphs
from paged.executor.step_plan import BatchInput, HostBatch


class StepGraphs:
    """The graphs of one KV cache (none: every step runs eagerly) and the steps counted so far."""

    def __init__(self, decode: DecodeGraphs | None = None, mixed: MixedGraphs | None = None) -> None:
        self.decode, self.mixed = decode, mixed
        self.cuda_graph_steps = self.eager_decode_steps = self.eager_mixed_steps = 0

    @classmethod
    def capture_on_demand(cls, forward: Forward, device: torch.device, max_num_seqs: int, max_num_batched_tokens: int,
                          max_model_len: int, block_size: int) -> StepGraphs:
        """Graphs for steps up to the scheduler's limits, each captured the first time a step needs
        it; decode and mixed graphs share one memory pool (no two replay at once)."""
        width = -(-max_model_len // block_size)
        decode = DecodeGraphs(forward, device, max_num_seqs, width, block_size)
        return cls(decode, MixedGraphs(forward, device, decode.pool, max_num_seqs, max_num_batched_tokens, width,
                                       block_size))

    def replay(self, host: HostBatch, version: str | None) -> tuple[torch.Tensor, BatchInput] | None:
        """The hidden states and device inputs of a replay of `host` with decode kernel `version`;
        None (and the step counted as eager) when it must run op by op."""
        if host.prefill is not None:
            replayed = self.mixed.run(host, version) if self.mixed is not None else None
        else:
            replayed = self.decode.run(host, version) if self.decode is not None and version else None
        if replayed is not None:
            self.cuda_graph_steps += 1
        elif host.prefill is None:
            self.eager_decode_steps += 1
        else:
            self.eager_mixed_steps += 1
        return replayed

    def counts(self) -> dict[str, int | None]:
        return {"cuda_graph_steps": self.cuda_graph_steps, "eager_decode_steps": self.eager_decode_steps,
                "eager_mixed_steps": self.eager_mixed_steps}
