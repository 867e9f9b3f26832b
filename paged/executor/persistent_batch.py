"""A decode batch's inputs kept on the host across steps and updated by what changed (vLLM V1's
persistent input batch, `InputBatch` and `_update_states`).

When a step schedules the very rows of the step before (the scheduler reuses them while nothing
changes: `paged.scheduler.steady`), every row again computes one token at the next position of the
same sequence, and its block table only gained blocks at its end. So the block tables are kept as
one array whose rows get the new entries only, and what else the step needs (positions, cache
slots, context lengths) comes from each sequence's length in a few numpy operations: no per-row
Python beyond reading that length and the token (a row computes its sequence's last token). The
arrays are `plan_batch`'s for the same step, value for value; any other step is planned by
`plan_batch`, and kept if it is a decode step of one KV group.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from paged.executor.step_plan import HostBatch, HostRows
from paged.step import ScheduledSeq, SchedulerOutput

_TOKENS = operator.attrgetter("seq.token_ids")
_TABLE = operator.attrgetter("block_table")
_PROMPT_LEN = operator.attrgetter("seq.num_prompt_tokens")
_PARAMS = operator.attrgetter("seq.request.params")


@dataclass
class _Rows:
    """The kept batch: its rows, their block tables as planned last ([n, widest table], zero
    padded) with each table's length then, and what cannot change while the rows are the same."""

    items: list[ScheduledSeq]
    tables: np.ndarray
    table_lens: np.ndarray
    prompt_lens: np.ndarray
    rows: np.ndarray  # int64 0..n-1: the rows, each its own sampling row (every row samples)
    query_start_loc: np.ndarray  # int32 0..n: one query a row
    argmax: bool  # every row takes its logits' argmax, whatever its length (no `min_tokens`)


class PersistentBatch:
    """The host side of a steady decode step: `plan` it from the kept rows, `keep` any other."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._rows: _Rows | None = None
        self.num_planned = 0  # steps planned from the kept rows (the tests' and benchmark's count)
        # whether every row of the step `plan` planned takes its logits' argmax (`takes_argmax`),
        # known of the kept rows once; False: not known, ask
        self.argmax = False

    def plan(self, sched: SchedulerOutput) -> HostBatch | None:
        """The step's inputs when it holds the kept rows, in order, and copies no block (which
        would change a table's entries, not only its length); else None."""
        kept, items = self._rows, sched.scheduled
        self.argmax = False
        if (kept is None or len(items) != len(kept.items) or sched.blocks_to_copy or sched.kv_offsets is not None
                or not all(map(operator.is_, items, kept.items))):
            return None
        n, bs = len(items), self.block_size
        # every row computes its sequence's last token (the rows sample: their steps complete them)
        token_ids = list(map(_TOKENS, items))
        num_tokens = np.fromiter(map(len, token_ids), dtype=np.int64, count=n)
        input_ids = np.fromiter(map(operator.itemgetter(-1), token_ids), dtype=np.int64, count=n)
        positions = num_tokens - 1
        block, offset = np.divmod(positions, bs)
        self._extend_tables(kept, items, np.flatnonzero(offset == 0))
        slots = kept.tables[kept.rows, block].astype(np.int64)
        slots *= bs
        slots += offset
        decode = HostRows(None, kept.tables.copy(), num_tokens.astype(np.int32), kept.query_start_loc.copy(),
                          int(num_tokens.max()), 1)
        self.num_planned += 1
        self.argmax = kept.argmax
        return HostBatch(input_ids, positions, slots, kept.rows.copy(), decode, None,
                         num_decode_tokens=int(np.count_nonzero(num_tokens > kept.prompt_lens)))

    def keep(self, sched: SchedulerOutput, host: HostBatch) -> None:
        """After `plan_batch` planned a step: keep its rows when they are all decode rows (one new
        token each) of one KV group, with no KV evicted before them."""
        rows = host.decode
        items = list(sched.scheduled)
        n = len(items)
        if (host.prefill is not None or rows is None or host.groups or sched.kv_offsets is not None
                or host.sample_rows.shape[0] != n):
            self._rows = None
            return
        self._rows = _Rows(items, rows.block_tables.copy(),
                           np.fromiter(map(len, map(_TABLE, items)), dtype=np.int64, count=n),
                           np.fromiter(map(_PROMPT_LEN, items), dtype=np.int64, count=n), np.arange(n),
                           np.arange(n + 1, dtype=np.int32),
                           all(p.argmax_only and not p.min_tokens for p in map(_PARAMS, items)))

    @staticmethod
    def _extend_tables(kept: _Rows, items: list[ScheduledSeq], rows: np.ndarray) -> None:
        """Bring the kept tables of `rows` (those whose step writes the first slot of a block: only
        they can have grown, as a table grows when a token needs a slot in a new block) to their
        length now, the array widened to the widest table. At a block's edge a row's table gained
        one block (all of a batch's rows at once when their lengths agree): those are set in one
        assignment, any other row on its own."""
        if not rows.size:
            return
        tables = list(map(_TABLE, map(items.__getitem__, rows.tolist())))
        new = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        old = kept.table_lens[rows]
        widest = int(new.max())
        if widest > kept.tables.shape[1]:
            wider = np.zeros((kept.tables.shape[0], widest), dtype=np.int32)
            wider[:, : kept.tables.shape[1]] = kept.tables
            kept.tables = wider
        if (new == old + 1).all():
            kept.tables[rows, old] = list(map(operator.itemgetter(-1), tables))
        else:
            for i in np.flatnonzero(new != old).tolist():
                kept.tables[rows[i], old[i] : new[i]] = tables[i][old[i] : new[i]]
        kept.table_lens[rows] = new
