"""What a scoring press reads of a step's attention (`paged.memory.press`: snapkv, h2o): each held
token's attention mass, summed over the KV heads and averaged over the layers, for the rows the
scheduler marks (`SchedulerOutput.score_rows`). The model's attention (`PagedAttention`) hands every
layer's queries and cache here after running its ops (`KernelBackend.attention_mass`)."""

from __future__ import annotations

import numpy as np
import torch

from paged.kernels.backends.interface import CacheView
from paged.kernels.planned import AttentionSettings, Rows
from paged.step import SchedulerOutput


class StepScores:
    """Sums the mass of the marked rows over a step's layers. `rows` are scheduled-row indices;
    `decode_rows` / `prefill_rows` map the step's decode and prefill ops' rows to them."""

    def __init__(self, rows: list[int], num_new: np.ndarray, last_queries: int | None) -> None:
        decode = num_new == 1
        self.wanted = set(rows)
        self.decode_rows = np.flatnonzero(decode).tolist()
        self.prefill_rows = np.flatnonzero(~decode).tolist()
        self.last_queries = last_queries
        self.sums: dict[int, torch.Tensor] = {}  # scheduled row -> fp32 [held]
        self.num_layers = 0

    @classmethod
    def of(cls, sched: SchedulerOutput) -> StepScores | None:
        """What `sched` asks scored (None: nothing, the step runs as without a press)."""
        if not sched.score_rows:
            return None
        num_new = np.fromiter((it.num_new_tokens for it in sched.scheduled), dtype=np.int64)
        return cls(sched.score_rows, num_new, sched.score_queries)

    def add(self, query: torch.Tensor, cache: CacheView, rows: Rows, settings: AttentionSettings,
            decode: bool) -> None:
        """One layer's decode (or prefill) rows: `query` is theirs, `cache` their view of the layer's cache."""
        mapping = self.decode_rows if decode else self.prefill_rows
        picked = [i for i, row in enumerate(mapping) if row in self.wanted]
        if not picked:
            return
        starts = rows.host_query_start_loc
        index = torch.tensor(picked, device=rows.block_tables.device)
        token_index = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in picked]).to(query.device)
        local_starts = np.concatenate([[0], np.cumsum([starts[i + 1] - starts[i] for i in picked])])
        view = CacheView(cache.key_cache, cache.value_cache, rows.block_tables[index], rows.seq_lens[index],
                         cache.k_scale, cache.v_scale)
        mass = settings.backend.attention_mass(query[token_index], view, local_starts, settings.scale,
                                               self.last_queries, settings.soft_cap).sum(dim=1)
        for j, i in enumerate(picked):
            length = int(rows.host_seq_lens[i])
            row = mapping[i]
            self.sums[row] = self.sums.get(row, 0) + mass[j, :length]

    def end_layer(self, layer: int) -> None:
        self.num_layers = max(self.num_layers, layer + 1)

    def scores(self, sched: SchedulerOutput) -> dict[int, np.ndarray]:
        """seq_id -> fp32 `[held]` mass averaged over the layers, of `sched`'s score rows."""
        layers = max(self.num_layers, 1)
        return {sched.scheduled[row].seq.seq_id: (total / layers).cpu().numpy() for row, total in self.sums.items()}
