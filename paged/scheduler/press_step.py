"""When the KV press judges a sequence, and what its compressions did (the summary's kv_press_* keys).

Before a step (`plan`): the slot copies the last step's compressions need go out first, every row
gets its evicted-token count (its KV index is its position less it), and the rows that complete a
prompt (or, with `interval` N, every N-th decode) while holding more than their budget are marked,
so that the executor returns their KV norms when the press reads them. After the step (`apply`),
each marked sequence still running is shown to the press and compressed by the block manager. A
request's forked samples are judged at their own next due step (with `interval` > 0).

With KV groups (`paged.memory.group_compaction`) the press judges each full-attention group of a
sequence apart, from that group's own norms or scores (the executor's are `[groups, held]`, one row
per compressed group), and the manager compresses every such group to its own keep set.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paged.memory.compaction import CompactingBlockManager
from paged.memory.group_compaction import CompactingGroupManager
from paged.memory.press import KVPress, PressView
from paged.request import SeqStatus, Sequence
from paged.step import ExecutorOutput, ScheduledSeq, SchedulerOutput


class PressStep:
    def __init__(self, press: KVPress, block_manager: CompactingBlockManager | CompactingGroupManager) -> None:
        self.press = press
        self.block_manager = block_manager
        self._copies: list[np.ndarray] = []  # compactions decided after the last step
        self.compaction_s = 0.0
        # seq_id -> accumulated mass per compressed group and held token, `[groups, held]` (`accumulates`)
        self._mass: dict[int, np.ndarray] = {}

    def plan(self, out: SchedulerOutput) -> None:
        """Fill the step's compaction copies, per-row evicted counts and the rows to judge after it."""
        if self._copies:
            out.slots_to_compact, self._copies = np.concatenate(self._copies), []
        bm = self.block_manager
        offsets = None
        if bm.has_compressed:
            offsets = out.kv_offsets = [bm.num_evicted(it.seq) for it in out.scheduled]
        out.press_rows = [i for i, it in enumerate(out.scheduled) if self._due(it, offsets[i] if offsets else 0)]
        out.press_norms = self.press.needs_norms
        if self.press.needs_scores:
            out.score_rows = list(range(len(out.scheduled))) if self.press.accumulates else out.press_rows
            out.score_queries = self.press.score_queries

    def _due(self, item: ScheduledSeq, evicted: int) -> bool:
        seq, context = item.seq, item.context_len
        if context != len(seq.token_ids):  # a prompt chunk that leaves some of it for later steps
            return False
        if item.is_decode and not (self.press.interval and seq.num_output_tokens % self.press.interval == 0):
            return False
        return context - evicted > self.press.budget(context)

    def apply(self, sched: SchedulerOutput, output: ExecutorOutput) -> None:
        """Judge the marked rows' sequences that still run, and compress those the press shrinks."""
        self.compaction_s += output.compaction_time_s
        bm = self.block_manager
        if self.press.accumulates:
            self._accumulate(sched, output)
        for row in sched.press_rows:
            seq = sched.scheduled[row].seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            keeps = self._judge(seq, output)
            if keeps is None:
                continue
            copies = bm.compress_each(seq, keeps)  # None: no room for the copies now; judged again when due
            if copies is not None and self.press.accumulates:
                self._mass[seq.seq_id] = np.stack([m[k] for m, k in zip(self._mass[seq.seq_id], keeps, strict=True)])
            if copies is not None and copies.shape[0]:
                self._copies.append(copies)

    def _judge(self, seq: Sequence, output: ExecutorOutput) -> list[np.ndarray] | None:
        """The press's keep set for each compressed group of `seq`, from that group's norms and
        scores; None when it keeps every held token (a sequence within its budget)."""
        key_norms, value_norms = output.kv_norms.get(seq.seq_id, (None, None))
        scores = self._mass.get(seq.seq_id) if self.press.accumulates else output.attention_scores.get(seq.seq_id)
        keeps = []
        for g, part in enumerate(self.block_manager.compacting):
            view = PressView(
                part.held_positions(seq), seq.num_computed_tokens, part.block_size,
                None if key_norms is None else key_norms[g], None if value_norms is None else value_norms[g],
                None if scores is None else scores[g],
            )
            keeps.append(self.press.keep(view))
        if all(k is None for k in keeps):
            return None
        held = self.block_manager.compacting[0].held_positions(seq).shape[0]
        return [np.arange(held) if k is None else k for k in keeps]

    def _accumulate(self, sched: SchedulerOutput, output: ExecutorOutput) -> None:
        """Adds the step's mass to each running sequence's sum (H2O's heavy hitters): a token cached
        this step starts at its first mass; a sequence that holds fewer tokens than its sum (recomputed
        after a preemption) starts over."""
        for row in sched.score_rows:
            seq = sched.scheduled[row].seq
            mass = output.attention_scores.get(seq.seq_id)
            if seq.status is not SeqStatus.RUNNING or mass is None:
                self._mass.pop(seq.seq_id, None)
                continue
            total = self._mass.get(seq.seq_id)
            if total is not None and total.shape[1] <= mass.shape[1]:
                mass = mass.copy()
                mass[:, : total.shape[1]] += total
            self._mass[seq.seq_id] = mass

    def summary(self) -> dict[str, Any]:
        """The summary.json keys of a run with a press (a run without one has none of them)."""
        parts = self.block_manager.compacting
        return {  # tokens and blocks summed over the compressed KV groups; a compression counts once
            "kv_press": self.press.name,
            "kv_press_num_compressions": parts[0].num_compressions,
            "kv_press_tokens_kept": sum(p.num_tokens_kept for p in parts),
            "kv_press_tokens_evicted": sum(p.num_tokens_evicted for p in parts),
            "kv_press_blocks_freed": sum(p.num_blocks_freed for p in parts),
            "kv_press_compaction_s": self.compaction_s,
        }
