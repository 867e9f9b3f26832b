"""Exact fast-forward of a simulated engine over decode iterations in which nothing can change
(`executor.fast_forward`, executor=sim).

A window is the run of steps, from now, in which every running sequence decodes one token and
nothing else can happen: no request waits, is swapped out, aborted or received; the batch fits the
token budget (so the running order is the batch order, whatever the policy); no sequence reaches
its length, a stop token or EOS (the finishing step is stepped); the free blocks cover every block
the window's growth takes (so no preemption); and the policy says it is step-invariant
(`SchedulingPolicy.step_invariant`). Anything outside that (beams and samples, stop strings,
logprobs, sliding windows, KV groups, prefix tiers, no-sharing copies, disaggregated pools, a KV
press) is stepped.

A window is planned when it starts (its last step, from the sequences' lengths and the free
blocks) and run, in one `Engine.step` call, up to the horizon its caller passes (the next arrival
it knows of: nothing reaches the engine before it), or one step a call without one
(`paged.engine.window_steps`, where the steps' bulk arithmetic is, to the bit stepping's). So at
every arrival the engine is exactly where stepping would have it: its clock, its blocks and prefix
cache, what a router reads of it. What arrives ends the window (`cut`, from `Engine.add_request`
and the aborts) before its next step, which the engine then schedules as it would have. So a
fleet's replica lags inside its window, past the arrivals its router sends elsewhere (`Fleet`;
`horizon` bounds the window's end, `prefix_unchanged` says whether a router's read can wait), and
the single engine runs up to its next arrival. Inside a window a step
does what stepping would, with the same arithmetic in the same order, and skips what cannot
change: the scheduler's queue walk, the policy, the batch objects.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from paged.engine.window_horizon import evicts, prefix_unchanged, steps_left
from paged.engine.window_steps import Hold, Row, Window, run_steps
from paged.memory import BlockManager
from paged.memory.reservation import ExactReservation, MaxReservation, OracleReservation, Pow2Reservation
from paged.request import Sequence
from paged.sim.executor import SimExecutor

if TYPE_CHECKING:
    from paged.engine.engine import Engine

log = logging.getLogger(__name__)

# the reservations whose growth over a window is known from now: the slots they cover grow with the
# sequence (exact) or stay what was reserved at admission (Orca's)
_RESERVATIONS = (ExactReservation, MaxReservation, Pow2Reservation, OracleReservation)
_NONE: frozenset[int] = frozenset()


class FastForward:
    """One engine's fast-forward: plans windows and runs them a step per `Engine.step`."""

    def __init__(self) -> None:
        self._window: Window | None = None
        self._said: set[str] = set()  # policy classes already logged as stepped
        self.num_windows = 0  # windows that ran a step
        self.num_steps = 0  # steps run in windows
        self.num_calls = 0  # calls that ran window steps (several steps a call up to a horizon)
        # a fleet's replica: where the steps after a call's first wait for their turn (`HeldSteps`)
        self.hold: Hold | None = None
        # the free blocks after each step of the latest call but its last (a replica's per-step record)
        self.free_blocks: list[int] = []

    def step(self, engine: Engine, until: float | None = None) -> bool:
        """Run the window's next step (planning a window if none is open), and with a horizon
        `until` every later one of the window that starts before it (`run_steps`); False when no
        window step can run now (the engine steps)."""
        self.free_blocks = []
        window = self._window or self._plan(engine)
        if window is None:
            return False
        first = window.done == 0
        ran = run_steps(engine, window, until, self.hold)
        if not ran:
            self._window = None
            return False
        self.free_blocks = window.free_blocks[:-1]
        self.num_windows += first
        self.num_steps += ran
        self.num_calls += 1
        return True

    def cut(self) -> None:
        """Something other than a step happened (an arrival, an abort): end the window here."""
        self._window = None

    def horizon(self, engine: Engine) -> float:
        """A lower bound of when the engine's next step that is not a window step starts (planning
        the window that starts now if none is open): the clock plus the window's steps left times a
        lower bound of any of their costs; the clock itself when its next step is not a window's."""
        now = engine.clock.now()
        window = self._window or self._plan(engine)
        if window is None:
            return now
        executor = engine.executor
        assert isinstance(executor, SimExecutor)
        floor = executor.decode_floor(len(window.rows))
        steps = steps_left(window, executor.vocab_size)
        if floor is None or steps <= 0:
            return now
        return now + steps * floor

    def prefix_unchanged(self, engine: Engine, chain: list[bytes], matched: int) -> bool:
        """Whether the open window's steps leave the prefix cache's match of `chain` at `matched`
        (`window_horizon.prefix_unchanged`); False without an open window."""
        window = self._window
        bm = engine.scheduler.block_manager
        return window is not None and isinstance(bm, BlockManager) and prefix_unchanged(window, bm, chain, matched)

    # -- planning ------------------------------------------------------------------------------------

    def _batch(self, engine: Engine) -> list[Sequence] | None:
        """The running sequences when every one decodes a plain token and nothing else can run; else None."""
        s = engine.scheduler
        if (s.waiting or s.swapped or s.receiving or s._pending_aborts or s.hands_off or not s.running
                or s.press_step is not None):  # a KV press plans compaction every step
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
        return list(s.running)

    def _policy_allows(self, policy: object) -> bool:
        invariant = getattr(policy, "step_invariant", None)
        if invariant is None:
            name = f"{type(policy).__module__}.{type(policy).__qualname__}"
            if name not in self._said:
                self._said.add(name)
                log.info("fast-forward: policy %s does not say whether it is step-invariant "
                         "(SchedulingPolicy.step_invariant): its engine steps one iteration at a time", name)
        return bool(invariant)

    def _plan(self, engine: Engine) -> Window | None:
        """The window that starts now; None when it would be empty."""
        if not isinstance(engine.executor, SimExecutor):
            return None
        seqs = self._batch(engine)
        if seqs is None:
            return None
        s = engine.scheduler
        max_model_len = s.max_model_len
        # the finishing step is stepped: the window ends before the first sequence's last token
        limit = min(
            min(seq.request.params.max_tokens - (len(seq.token_ids) - seq.num_prompt_tokens),
                max_model_len - len(seq.token_ids))
            for seq in seqs
        ) - 1
        if limit < 1:
            return None
        lengths = [len(seq.token_ids) for seq in seqs]
        # the blocks the window's growth takes (what `try_append_slots` adds, ExactReservation or a
        # larger reservation alike), which the free blocks must cover: else a step could preempt
        limit, new_blocks = self._block_limit(s.block_manager, seqs, lengths, limit)
        if limit < 1:
            return None
        eos, bm = s.eos_token_ids, s.block_manager
        bs, refcount, reservation = bm.block_size, bm.allocator.refcount, bm.reservation
        publishes = bm.prefix_index.enabled
        rows = []
        for seq, length in zip(seqs, lengths):
            request = seq.request
            params = request.params
            # no stop token ids (nearly every row): the EOS set itself (or the empty one), no new set per row
            stop_ids = params.stop_token_ids
            stops = ((frozenset(stop_ids) | (_NONE if params.ignore_eos else eos)) if stop_ids
                     else _NONE if params.ignore_eos else eos)
            blocks = bm.seq_blocks(seq)
            # `try_append_slots`' common-path test and `mark_computed`'s early return, as they ask them
            common = (
                (length - 1) % bs and length % bs and blocks.num_slots == length - 1 == seq.num_computed_tokens
                and refcount(blocks.table[(length - 1) // bs]) == 1
                and reservation.growth_slots(seq) <= len(blocks.table) * bs
                and (not publishes or length // bs <= blocks.num_published)
            )
            # a stop token ends the sequence once its output, the token included, reaches min_tokens
            rows.append(Row(seq, seq.token_ids, request.token_times, 0 if params.greedy else seq.index + 1,
                            blocks, stops, seq.num_prompt_tokens + params.min_tokens - 1, not common))
        # the rows a token could stop first: the steps' tokens are walked only as far as the first stop
        order = sorted(range(len(rows)), key=lambda r: not rows[r].stops)
        self._window = Window(rows, limit, lengths, order, evicts=evicts(bm, new_blocks))
        return self._window

    @staticmethod
    def _block_limit(bm: BlockManager, seqs: list[Sequence], lengths: list[int], limit: int) -> tuple[int, int]:
        """The steps (at most `limit`) whose growth the free blocks cover, and the blocks they take."""
        bs = bm.block_size
        # a contiguous allocator's extents: only a window that adds no block is planned here
        free = 0 if bm.allocator.contiguous else bm.allocator.num_free_blocks
        tables = [len(bm.block_table(seq)) for seq in seqs]
        # what each reservation covers does not change while the window is planned: asked once, not per probe
        grows = list(map(bm.reservation.growth_slots, seqs))

        def needed(k: int) -> int:
            # after k steps a sequence has length + k tokens; its table covers them (and its reservation)
            total = 0
            for length, grow, table in zip(lengths, grows, tables):
                covered = max(length + k - 1, grow)
                total += max(-(-covered // bs) - table, 0)
            return total

        total = needed(limit)
        if total <= free:
            return limit, total
        lo, hi = 0, limit  # the largest k with needed(k) <= free: needed grows with k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if needed(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo, needed(lo)
