"""A fast-forward window's steps run many at a time (`paged.engine.fast_forward` plans the window).

`run_steps` runs, in one call, the window's steps that start before a horizon (the next event its
caller knows of: an arrival), as stepping would run them one by one, to the bit:

- costs: the cost model's, per step, on the step's context lengths, all of a call's in one pass
  (`SimExecutor.step_costs`: each step's end, model time and kernel version); the clock set to the
  last end (the same additions in the same order), token times the steps' ends;
- tokens: `plain_token`'s recurrence per row (Python integers); the call ends before the first
  step whose token would stop a row;
- blocks: the block manager is called only at a row's block edges (a step that opens a block, or
  the window's first step where the common path's test fails, grows the table: `open_block` where
  the table is full, else `try_append_slots`; one that fills a block publishes it), in stepping's
  (step, row) order, so the same blocks go to the same rows; before each such call, and at the
  end, the steps a row ran off an edge are booked in the ledger in one call
  (`SlotLedger.append_tokens`), and its token list, computed count and slots brought to where that
  step finds them;
- statistics: each step's `decode_step`, from the ledger's slots after it (the used and reserved
  counts rebuilt from each run's and each edge call's changes) and the blocks as the latest
  table-growing step left them (a `DecodeKV` of the block manager's counts); `_count` counts them,
  or holds them for their turn where it is given `hold` (a fleet's replica, `HeldSteps`). A run
  that keeps step records runs one step a call (`_one_step`), its record made from the
  scheduler's stats as before.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from paged.engine.held_steps import Hold
from paged.engine.step_stats import DecodeKV
from paged.memory.block_manager import BlockManager, _SeqBlocks
from paged.request import Sequence
from paged.sim.decode_steps import StepSums, StepTotals
from paged.sim.executor import LENGTH_MUL, SAMPLE_MUL, TOKEN_MUL, SimExecutor

if TYPE_CHECKING:
    from paged.engine.engine import Engine

@dataclass(slots=True)
class Row:
    """One sequence of a window: its token list and times, its placeholder's inputs, its blocks, and
    its stop tokens with the length from which they stop it."""

    seq: Sequence
    token_ids: list[int]
    token_times: array[float]
    sample: int  # plain_token's sample term over SAMPLE_MUL: 0 for a greedy row, else its index + 1
    blocks: _SeqBlocks
    stops: frozenset[int]
    stop_from: int
    # whether the window's first step must go through the block manager (else its slot is the
    # common path's and publishing has nothing new, as on any step off a block's edge)
    first_edge: bool


@dataclass(slots=True)
class Window:
    """A planned window: per sequence, what its steps read and write (`Row`); the steps run and the
    most it may run."""

    rows: list[Row]
    limit: int
    contexts: list[int]  # the next step's context lengths: each row's tokens so far
    order: list[int]  # the rows, those a stop token or EOS could end first
    done: int = 0
    kv: DecodeKV | None = None  # the cache after the latest step that grew a block table (statistics only)
    free_blocks: list[int] = field(default_factory=list)  # the free blocks after each step of the latest call
    sums: StepSums | None = None  # the step costs' sums, from the window's first step on
    evicts: bool = True  # whether the window's growth could evict a cached block (`window_horizon.evicts`)
    stop_at: int | None = None  # the step a token would stop a row at, once looked for (`window_horizon`)


def _tokens(window: Window, vocab: int, k: int) -> tuple[list[list[int]], int]:
    """Per row, the tokens its next steps sample (`plain_token`'s recurrence), and how many steps
    run: at most `k`, ending before the first step whose token would stop a row (a stop token once
    its length reaches `stop_from`). The rows that could stop are walked first, each only as far as
    the earliest stop found so far."""
    rows, contexts = window.rows, window.contexts
    tokens: list[list[int]] = [[] for _ in rows]
    for r in window.order:
        row = rows[r]
        last, stops, out = row.token_ids[-1], row.stops, tokens[r]
        # the recurrence's step term, (length + j) x LENGTH_MUL + the sample's, grown by LENGTH_MUL a step
        term = contexts[r] * LENGTH_MUL + SAMPLE_MUL * row.sample
        if not stops:
            append = out.append
            for _ in range(k):
                last = (last * TOKEN_MUL + term) % vocab
                append(last)
                term += LENGTH_MUL
            continue
        stop_j = row.stop_from - contexts[r]  # the first step from which a stop token stops the row
        for j in range(k):
            last = (last * TOKEN_MUL + term) % vocab
            if last in stops and j >= stop_j:
                k = j
                break
            out.append(last)
            term += LENGTH_MUL
    return tokens, k


def _edges(window: Window, bs: int, k: int) -> dict[int, tuple[list[int], list[int]]]:
    """step -> the rows (in row order) whose slot there the block manager must give (the step opens
    a block: (tokens - 1) % bs == 0, or it is the window's first step and the common path's test
    fails), and those whose computed blocks it must publish (those, and the steps that fill a
    block: tokens % bs == 0); step 0 of a window is always listed (its cache is counted)."""
    edges: dict[int, tuple[list[int], list[int]]] = {}
    first = window.done == 0
    if first:
        edges[0] = ([], [])
    for r, (row, length) in enumerate(zip(window.rows, window.contexts)):
        fill = (-length) % bs
        grow = first and row.first_edge
        if (fill + 1) % bs >= k and not grow:  # no block opens in these steps (most rows); one may fill
            if fill < k:
                edges.setdefault(fill, ([], []))[1].append(r)
            continue
        opens = range((fill + 1) % bs, k, bs)
        fills = range(fill, k, bs) if bs > 1 else range(0)
        if grow and (opens.start != 0 or not opens):
            edges[0][0].append(r)
            edges[0][1].append(r)
        for j in opens:
            entry = edges.setdefault(j, ([], []))
            entry[0].append(r)
            entry[1].append(r)
        for j in fills:
            if not (grow and j == 0):
                edges.setdefault(j, ([], []))[1].append(r)
    for _, published in edges.values():
        published.sort()
    return dict(sorted(edges.items()))


def run_steps(engine: Engine, window: Window, until: float | None, hold: Hold | None = None) -> int:
    """Run the window's next steps: the first, and with a horizon `until` every later one that
    starts before it (None: the first only). Returns how many ran; 0 (nothing changed) when the
    window is over: its last planned step ran, a token would stop a row, or the cost model cannot
    price the next step from its rows alone. `hold` takes the statistics of every step (its start,
    its `decode_step`) instead of counting them now (a fleet's `HeldSteps`)."""
    metrics = engine.metrics
    records = metrics.records_steps
    cap = window.limit - window.done
    if until is None or records:
        cap = min(cap, 1)
    if cap <= 0:
        return 0
    executor = engine.executor
    assert isinstance(executor, SimExecutor)
    start = engine.clock.now()
    contexts = window.contexts
    if window.sums is None:
        window.sums = StepSums([c - window.done for c in contexts])
    steps = executor.step_costs(window.sums, window.done, cap, start, float("-inf") if until is None else until)
    if steps is None or not steps.ends:
        return 0
    token_lists, k = _tokens(window, executor.vocab_size, len(steps.ends))
    if k == 0:
        return 0
    if k == 1:
        _one_step(engine, window, steps, token_lists, hold)
        return 1
    s = engine.scheduler
    bm = s.block_manager
    ledger, bs, publishes = bm.ledger, bm.block_size, bm.prefix_index.enabled
    rows, n = window.rows, len(window.rows)
    used0, reserved0 = ledger.num_used, ledger.num_reserved
    # per step: the ledger's change in used and reserved slots
    d_used = [n] * k
    d_reserved = [0] * k
    ran = [0] * n  # steps of each row booked so far

    def book(r: int, upto: int) -> None:
        """Book row r's steps from the last booked to `upto` (exclusive), all in one block."""
        row, first = rows[r], ran[r]
        count = upto - first
        if count <= 0:
            return
        length = contexts[r]
        blocks = row.blocks
        reserved = ledger.append_tokens(blocks.table[(length + first - 1) // bs], count)
        for j in range(first, first + reserved):
            d_reserved[j] -= 1
        row.token_ids.extend(token_lists[r][first:upto])
        row.seq.num_computed_tokens = blocks.num_slots = length + upto - 1
        ran[r] = upto

    kvs: dict[int, DecodeKV] = {}
    for j, (grown, published) in _edges(window, bs, k).items():
        for r in grown:
            book(r, j)
            used, reserved = ledger.num_used, ledger.num_reserved
            if not bm.open_block(rows[r].seq) and bm.try_append_slots(rows[r].seq) != []:
                raise AssertionError(f"fast-forward: sequence {rows[r].seq.seq_id} could not grow as planned")
            d_used[j] += ledger.num_used - used - 1
            d_reserved[j] += ledger.num_reserved - reserved
            # the step's token is appended first here, which publishing ignores (computed slots only)
            rows[r].token_ids.append(token_lists[r][j])
            rows[r].seq.num_computed_tokens = contexts[r] + j
            ran[r] = j + 1
        if publishes:
            for r in published:
                book(r, j + 1)
            used, reserved = ledger.num_used, ledger.num_reserved
            for r in published:
                bm.mark_computed(rows[r].seq)
            d_used[j] += ledger.num_used - used
            d_reserved[j] += ledger.num_reserved - reserved
        if grown or j == 0:
            kvs[j] = _decode_kv(bm)
    for r in range(n):  # `book(r, k)`, inlined: most rows of a call have no edge
        count = k - ran[r]
        if count:
            row = rows[r]
            blocks, length = row.blocks, contexts[r]
            reserved = ledger.append_tokens(blocks.table[(length + k - count - 1) // bs], count)
            for j in range(k - count, k - count + reserved):
                d_reserved[j] -= 1
            if count == 1:
                row.token_ids.append(token_lists[r][k - 1])
            else:
                row.token_ids.extend(token_lists[r][k - count:k])
            row.seq.num_computed_tokens = blocks.num_slots = length + k - 1
    s._blocked_blocks = 0
    executor.advance_steps(contexts, steps, k)
    ends = steps.ends
    s._now = ends[k - 1]
    times = array("d", ends[:k]) if k < len(ends) else array("d", ends)
    for row in rows:
        row.token_times.extend(times)
    if window.done == 0:  # a log-probability of -0.0 becomes 0.0 once, as the first step adds 0.0
        for row in rows:
            row.seq.cumulative_logprob += 0.0
    window.contexts = [c + k for c in contexts]
    window.free_blocks = _count(engine, window, steps, k, start, kvs, used0, reserved0, d_used, d_reserved, hold)
    window.done += k
    return k


def _decode_kv(bm: BlockManager) -> DecodeKV:
    """The cache as `bm.stats()` gives it, as a decode step's statistics read it: from its block
    counts where `stats` is `BlockManager`'s (no request waits for memory in a window, so no free
    block is stranded), else from `stats()`."""
    if type(bm).stats is not BlockManager.stats:
        return DecodeKV.of(bm.stats())
    total, free, unassigned, logical = bm.block_counts()
    return DecodeKV(bm.block_size, total, free, unassigned, 0, logical)


def _count(engine: Engine, window: Window, steps: StepTotals, k: int, start: float, kvs: dict[int, DecodeKV],
           used: int, reserved: int, d_used: list[int], d_reserved: list[int], hold: Hold | None) -> list[int]:
    """Each of the first `k` steps' statistics, in step order (`decode_step`), with the ledger's
    slots after it and the cache as the latest edge left it: counted, or with `hold` held for its
    turn. Returns the free blocks after each step."""
    n = len(window.rows)
    count = engine.metrics.step_stats.count
    ends, model_times, versions = steps.ends, steps.model_times, steps.versions
    kv = window.kv
    free_blocks = []
    for j in range(k):
        used += d_used[j]
        reserved += d_reserved[j]
        edge = kvs.get(j)
        if edge is not None:
            kv = edge
        assert kv is not None
        end = ends[j]
        step = kv.step(n, model_times[j], versions[j], used, reserved, start, end)
        if hold is not None:
            hold(start, step)
        else:
            count(step)
        free_blocks.append(kv.num_free_blocks)
        start = end
    window.kv = kv
    return free_blocks


def _one_step(engine: Engine, window: Window, steps: StepTotals, token_lists: list[list[int]], hold: Hold | None
              ) -> None:
    """`run_steps` for a single step (a fleet's replica, a window's last step before an arrival),
    without its bookkeeping for many: a row's slot goes into the private block the previous step
    wrote, unless it opens a block or fills one (or, on the window's first step, the common path's
    test fails), where the block manager grows and publishes as a step does."""
    executor = engine.executor
    assert isinstance(executor, SimExecutor)
    s = engine.scheduler
    bm = s.block_manager
    bs, append_token = bm.block_size, bm.ledger.append_token
    first = window.done == 0
    contexts = window.contexts
    start = engine.clock.now()
    s._blocked_blocks = 0
    edges = []
    for row in window.rows:
        num_tokens = len(row.token_ids)
        if (num_tokens - 1) % bs == 0 or num_tokens % bs == 0 or (first and row.first_edge):
            if not bm.open_block(row.seq) and bm.try_append_slots(row.seq) != []:
                raise AssertionError(f"fast-forward: sequence {row.seq.seq_id} could not grow as planned")
            edges.append(row)
        else:
            blocks = row.blocks
            append_token(blocks.table[(num_tokens - 1) // bs])
            blocks.num_slots = num_tokens
    executor.advance_steps(contexts, steps, 1)
    now = engine.clock.now()
    s._now = now
    for row, tokens in zip(window.rows, token_lists):
        row.seq.num_computed_tokens = len(row.token_ids)
        row.token_times.append(now)
        row.token_ids.append(tokens[0])
    for row in edges:
        # the token is appended first here, which publishing ignores (it covers computed slots only)
        bm.mark_computed(row.seq)
    if first:  # a log-probability of -0.0 becomes 0.0 once, as the first step adds 0.0
        for row in window.rows:
            row.seq.cumulative_logprob += 0.0
    window.contexts = [c + 1 for c in contexts]
    window.done += 1
    window.free_blocks = []
    metrics = engine.metrics
    n = len(window.rows)
    if metrics.records_steps:
        metrics.add_step(metrics.step_record(
            False, n, n, n, n, n, steps.model_times[0], steps.versions[0], 0, 0, s.stats(), start, now,
        ))
        return
    # off a block's edge a step changes only the ledger's slots: the blocks are the last edge's
    ledger = bm.ledger
    _count(engine, window, steps, 1, start, {0: _decode_kv(bm)} if first or edges else {}, ledger.num_used,
           ledger.num_reserved, [0], [0], hold)
