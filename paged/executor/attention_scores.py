"""What a scoring press reads of a step's attention (`paged.memory.press`: snapkv, h2o): each held
token's attention mass, summed over the KV heads and averaged over a KV group's layers, per
compressed group (`KVLayout.full_groups`; the one group of a model without KV groups), for the rows
the scheduler marks (`SchedulerOutput.score_rows`). The model's attention (`PagedAttention`) hands
every layer's queries and cache here after running its ops (`KernelBackend.attention_mass`)."""

from __future__ import annotations

import numpy as np
import torch

from paged.kernels.backends.interface import CacheView
from paged.kernels.planned import AttentionSettings, Rows
from paged.kv_layout import KVLayout
from paged.step import SchedulerOutput


class StepScores:
    """Sums the mass of the marked rows over each compressed group's layers. `rows` are
    scheduled-row indices; `decode_rows` / `prefill_rows` map the step's decode and prefill ops'
    rows to them; `layout` says which groups are compressed and how many layers each has."""

    def __init__(self, rows: list[int], num_new: np.ndarray, last_queries: int | None, layout: KVLayout) -> None:
        decode = num_new == 1
        self.wanted = set(rows)
        self.decode_rows = np.flatnonzero(decode).tolist()
        self.prefill_rows = np.flatnonzero(~decode).tolist()
        self.last_queries = last_queries
        # group -> its index among the compressed groups, and its layer count
        self.groups = {g: i for i, g in enumerate(layout.full_groups)}
        self.num_layers = [len(layout.groups[g].layers) for g in layout.full_groups]
        self.sums: dict[tuple[int, int], torch.Tensor] = {}  # (scheduled row, compressed group) -> fp32 [held]

    @classmethod
    def of(cls, sched: SchedulerOutput, layout: KVLayout) -> StepScores | None:
        """What `sched` asks scored (None: nothing, the step runs as without a press)."""
        if not sched.score_rows:
            return None
        num_new = np.fromiter((it.num_new_tokens for it in sched.scheduled), dtype=np.int64)
        return cls(sched.score_rows, num_new, sched.score_queries, layout)

    def add(self, query: torch.Tensor, cache: CacheView, rows: Rows, settings: AttentionSettings,
            decode: bool, group: int = 0) -> None:
        """One layer's decode (or prefill) rows: `query` is theirs, `cache` their view of the layer's
        cache, read through KV group `group`'s tables (a windowed group's layers are not scored)."""
        compressed = self.groups.get(group)
        if compressed is None:
            return
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
            key = mapping[i], compressed
            self.sums[key] = self.sums.get(key, 0) + mass[j, :length]

    def scores(self, sched: SchedulerOutput) -> dict[int, np.ndarray]:
        """seq_id -> fp32 `[compressed groups, held]` mass averaged over each group's layers, of
        `sched`'s score rows."""
        rows = sorted({row for row, _ in self.sums})
        return {sched.scheduled[row].seq.seq_id: torch.stack([self.sums[row, i] / n for i, n in
                                                              enumerate(self.num_layers)]).cpu().numpy()
                for row in rows}
