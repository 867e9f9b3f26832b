"""Exact fast-forward of a simulated engine over decode iterations in which nothing can change
(`executor.fast_forward`, executor=sim).

A window is the run of steps, from now, in which every running sequence decodes one token and
nothing else can happen: no request waits, is swapped out, aborted or received; the batch fits the
token budget (so the running order is the batch order, whatever the policy); no step starts at or
after the next arrival (`Engine.horizon`: an arrival is submitted before a step that starts at its
time); no sequence reaches its length, a stop token or EOS (the finishing step is stepped); the
free blocks cover every block the window's growth takes (so no preemption); and the policy says
it is step-invariant (`SchedulingPolicy.step_invariant`). Anything outside that (beams and
samples, stop strings, logprobs, sliding windows, KV groups, prefix tiers, no-sharing copies,
disaggregated pools) is stepped.

Inside a window the engine does what stepping would, with the same arithmetic in the same order,
and skips what cannot change: the scheduler's queue walk, the policy, the batch objects. Each
step's cost is the sim's cost model on the step's context lengths (`SimExecutor.decode_cost`); the
blocks are grown by the block manager as a step grows them (so the same blocks, in the same order);
tokens are the executor's placeholders and their times the step ends. Each step's record is queued
and handed to the metrics one per `Engine.step` call, so that a fleet's replicas interleave their
records (and the router sees their KV usage) exactly as when they step (`Engine.next_step_time`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged.engine.metrics import MetricsRecorder, StepRecord
from paged.memory import BlockManager
from paged.memory.reservation import ExactReservation, MaxReservation, OracleReservation, Pow2Reservation
from paged.request import Sequence
from paged.sim.executor import SimExecutor, plain_token

if TYPE_CHECKING:
    from paged.engine.engine import Engine

log = logging.getLogger(__name__)

# the reservations whose growth over a window is known from now: the slots they cover grow with the
# sequence (exact) or stay what was reserved at admission (Orca's)
_RESERVATIONS = (ExactReservation, MaxReservation, Pow2Reservation, OracleReservation)


@dataclass(slots=True)
class _Step:
    """A fast-forwarded step waiting to be handed to the metrics: its start, its record, and the
    KV usage a router reads after it (`Scheduler.kv_usage`'s arithmetic)."""

    start: float
    record: StepRecord
    kv_usage: float


class FastForward:
    """One engine's fast-forward: finds and runs windows, then hands their records out in order."""

    def __init__(self) -> None:
        self._pending: deque[_Step] = deque()
        self._kv_usage: float | None = None  # after the latest step handed out, while a window drains
        self._said: set[str] = set()  # policy classes already logged as stepped

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def next_start(self) -> float | None:
        """The start of the next queued step; None when none is queued."""
        return self._pending[0].start if self._pending else None

    def kv_usage(self) -> float | None:
        """The KV usage after the latest step handed out, while a window's steps are queued."""
        return self._kv_usage if self._pending else None

    def step(self, engine: Engine) -> bool:
        """Hand out the next queued step, or run a window and hand out its first; False when no
        window can start now (the engine steps)."""
        if not self._pending and not self._run(engine):
            return False
        self._emit(engine.metrics)
        return True

    def flush(self, metrics: MetricsRecorder) -> None:
        """Hand out every queued step (before anything that is not a step: an abort)."""
        while self._pending:
            self._emit(metrics)

    def _emit(self, metrics: MetricsRecorder) -> None:
        step = self._pending.popleft()
        self._kv_usage = step.kv_usage
        metrics.add_step(step.record)

    # -- a window ------------------------------------------------------------------------------------

    def _batch(self, engine: Engine) -> list[Sequence] | None:
        """The running sequences when every one decodes a plain token and nothing else can run; else None."""
        s = engine.scheduler
        if s.waiting or s.swapped or s.receiving or s._pending_aborts or s.hands_off or not s.running:
            return None
        bm = s.block_manager
        if (not isinstance(bm, BlockManager) or bm.sliding_window is not None or not bm.share_blocks
                or bm.prefix_index.tiers is not None or len(s.running) > s.max_num_batched_tokens
                or type(bm.reservation) not in _RESERVATIONS):
            return None
        if not self._policy_allows(s.policy):
            return None
        for seq in s.running:
            request = seq.request
            params = request.params
            if (params.best_of != 1 or len(request.seqs) != 1 or seq.detokenizer is not None
                    or seq.logprobs is not None or len(seq.token_ids) - seq.num_computed_tokens != 1
                    or len(seq.token_ids) <= seq.num_prompt_tokens):
                return None
        return s.running

    def _policy_allows(self, policy: object) -> bool:
        invariant = getattr(policy, "step_invariant", None)
        if invariant is None:
            name = f"{type(policy).__module__}.{type(policy).__qualname__}"
            if name not in self._said:
                self._said.add(name)
                log.info("fast-forward: policy %s does not say whether it is step-invariant "
                         "(SchedulingPolicy.step_invariant): its engine steps one iteration at a time", name)
        return bool(invariant)

    def _run(self, engine: Engine) -> bool:
        """Run the window that starts now, queueing its steps; False when it is empty."""
        executor = engine.executor
        if not isinstance(executor, SimExecutor):
            return False
        seqs = self._batch(engine)
        if seqs is None:
            return False
        s = engine.scheduler
        max_model_len = s.max_model_len
        # the finishing step is stepped: the window ends before the first sequence's last token
        limit = min(
            min(seq.request.params.max_tokens - (len(seq.token_ids) - seq.num_prompt_tokens),
                max_model_len - len(seq.token_ids))
            for seq in seqs
        ) - 1
        if limit < 1:
            return False
        lengths = [len(seq.token_ids) for seq in seqs]
        bm = s.block_manager
        # the blocks the window's growth takes (what `try_append_slots` adds, ExactReservation or a
        # larger reservation alike), which the free blocks must cover: else a step could preempt
        limit = self._block_limit(bm, seqs, lengths, limit)
        costs = self._costs(executor, lengths, limit, engine.clock.now(), engine.horizon)
        num_steps = self._stop_limit(executor, s.eos_token_ids, seqs, len(costs))
        if num_steps < 1:
            return False
        self._apply(engine, executor, seqs, costs[:num_steps])
        return True

    @staticmethod
    def _block_limit(bm: BlockManager, seqs: list[Sequence], lengths: list[int], limit: int) -> int:
        """The steps (at most `limit`) whose growth the free blocks cover."""
        bs = bm.block_size
        # a contiguous allocator's extents: only a window that adds no block is planned here
        free = 0 if bm.allocator.contiguous else bm.allocator.num_free_blocks
        tables = [len(bm.block_table(seq)) for seq in seqs]
        reservation = bm.reservation

        def needed(k: int) -> int:
            # after k steps a sequence has length + k tokens; its table covers them (and its reservation)
            total = 0
            for seq, length, table in zip(seqs, lengths, tables):
                covered = max(length + k - 1, reservation.growth_slots(seq))
                total += max(-(-covered // bs) - table, 0)
            return total

        if needed(limit) <= free:
            return limit
        lo, hi = 0, limit  # the largest k with needed(k) <= free: needed grows with k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if needed(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @staticmethod
    def _costs(executor: SimExecutor, lengths: list[int], limit: int, now: float, horizon: float) -> list:
        """The window's step costs, each step starting before `horizon` (at most `limit` steps)."""
        costs = []
        start = now
        for k in range(limit):
            if start >= horizon:
                break
            cost = executor.decode_cost([n + k for n in lengths])
            if cost is None:
                break
            costs.append(cost)
            start += cost.total_s
        return costs

    @staticmethod
    def _stop_limit(executor: SimExecutor, eos: frozenset[int], seqs: list[Sequence], limit: int) -> int:
        """The steps (at most `limit`) before the first token that a stop token or EOS would end on."""
        vocab = executor.vocab_size
        for seq in seqs:
            params = seq.request.params
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
            if not stops:
                continue
            last, length = seq.token_ids[-1], len(seq.token_ids)
            num_output = length - seq.num_prompt_tokens
            for k in range(limit):
                token = plain_token(last, length + k, vocab, params.greedy, seq.index)
                if token in stops and num_output + k + 1 >= params.min_tokens:
                    limit = k
                    break
                last = token
        return limit

    def _apply(self, engine: Engine, executor: SimExecutor, seqs: list[Sequence], costs: list) -> None:
        """Run the window's steps as stepping would, queueing their records."""
        s = engine.scheduler
        bm = s.block_manager
        clock, metrics = engine.clock, engine.metrics
        try_append, mark_computed = bm.try_append_slots, bm.mark_computed
        allocator = bm.allocator
        vocab, n = executor.vocab_size, len(seqs)
        rows = [(seq, seq.request, seq.request.params.greedy, seq.index) for seq in seqs]
        for cost in costs:
            start = clock.now()
            s._blocked_blocks = 0
            for seq in seqs:
                if try_append(seq) != []:
                    raise AssertionError(f"fast-forward: sequence {seq.seq_id} could not grow as planned")
            executor.advance(cost)
            now = clock.now()
            s._now = now
            for seq, request, greedy, index in rows:
                token_ids = seq.token_ids
                token = plain_token(token_ids[-1], len(token_ids), vocab, greedy, index)
                seq.num_computed_tokens += 1
                mark_computed(seq)
                request.token_times.append(now)
                token_ids.append(token)
                seq.cumulative_logprob += 0.0
            total = cost.total_s
            record = metrics.step_record(
                False, n, n, n, n, n, total - cost.overhead_s, cost.decode_version, 0, 0, s.stats(), start, now,
            )
            self._pending.append(_Step(start, record, 1.0 - allocator.num_free_blocks / allocator.num_blocks))
