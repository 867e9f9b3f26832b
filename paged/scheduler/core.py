"""Continuous (iteration-level) batching with chunked prefill. `Scheduler` (with its update half in
`update`) is the one place where sequence state changes.

Each step fills a token budget (`max_num_batched_tokens`) and up to `max_num_seqs` seats. With
`batch_order=decode-first` (vLLM V1, Sarathi's stall-free batching) the running requests come first
(a token for each decoding sequence, the next chunk of each prompt in progress), then swap-ins, then
new requests in the policy's order, each admitted with blocks for its whole prompt and computed in
chunks of what budget is left (`chunked_prefill`, capped by `long_prefill_token_threshold`; at most
`max_num_partial_prefills` prompts stay part-computed between steps). `prefill-first` admits before
it decodes; without chunked prefill a step that admits anything is then prefill-only (vLLM V0).
A waiting request whose next uncached block another request is computing waits a step to hit it
(`prefix_dedup`). When a decoding sequence cannot get a slot for its next token, the policy picks a
victim among the requests not yet scheduled and the preemption mode takes its blocks: recomputed, it
rejoins the waiting queue; swapped out, the swapped queue, which is served before any new request
(swap-ins join a step in which nothing was preempted). A preemptive policy also displaces running
requests that its best waiting one outranks (they are recomputed). A request's sequences (samples,
beams) are gang scheduled, as the paper's sequence groups: admitted, preempted and swapped in all
together, and never chunked (`budget`: a step's tokens and seats, gangs, chunks). A request that
can never run is aborted with the reason (`rejection`). `update_from_output` (`update`) applies what
the executor computed and sampled (under async scheduling `lagged_update`, a step late); `handoff`
moves a request between the prefill and decode pools of a disaggregated fleet.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from paged.config import SchedulerConfig
from paged.memory import AllocStatus, BlockManager
from paged.memory.compaction import CompactingBlockManager
from paged.memory.group_compaction import CompactingGroupManager
from paged.memory.kv_groups import KVGroupManager
from paged.memory.press import KVPress
from paged.request import FinishReason, Request, SeqStatus, Sequence
from paged.scheduler.budget import StepBudget, gang_of, grow, running_gangs, seats, seats_in_use
from paged.scheduler.handoff import HandoffMixin
from paged.scheduler.kv_queries import KVQueriesMixin
from paged.scheduler.lagged_update import LaggedUpdateMixin
from paged.scheduler.policy import SchedulingPolicy
from paged.scheduler.preemption import PreemptionMode, RecomputePreemption
from paged.scheduler.press_step import PressStep
from paged.scheduler.rejection import allocation_rejection, intake_rejection, swap_in_rejection
from paged.scheduler.sequence_group import SequenceGroup, make_group
from paged.scheduler.steady import SteadyMixin
from paged.scheduler.stop import watch_stop_strings
from paged.scheduler.update import UpdateMixin
from paged.step import ScheduledSeq, SchedulerOutput, SchedulerStats


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    num_aborted: int = 0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    num_swapped_blocks: int = 0  # blocks moved either way


class Scheduler(UpdateMixin, LaggedUpdateMixin, HandoffMixin, KVQueriesMixin, SteadyMixin):
    def __init__(
        self,
        cfg: SchedulerConfig,
        block_manager: BlockManager | KVGroupManager,
        policy: SchedulingPolicy,
        *,
        preemption: PreemptionMode | None = None,
        eos_token_ids: Collection[int] = (),
        tokenizer: Any = None,
        vocab_size: int | None = None,
        press: KVPress | None = None,
    ) -> None:
        self.cfg = cfg
        # plain ints: the per-token checks must not pay for a config-node lookup
        self.max_model_len = int(cfg.max_model_len)
        self.max_num_seqs = int(cfg.max_num_seqs)
        self.max_num_batched_tokens = int(cfg.max_num_batched_tokens)
        self.chunked_prefill = bool(cfg.chunked_prefill)
        self.prefill_first = cfg.batch_order == "prefill-first"
        self.max_num_partial_prefills = int(cfg.max_num_partial_prefills)
        self.long_prefill_token_threshold = int(cfg.long_prefill_token_threshold)
        self.prefix_dedup = bool(cfg.prefix_dedup)
        self.block_manager = block_manager
        # with KV groups per layer type, every group's tables go to the executor; None: one group
        self._group_tables = block_manager.group_tables if isinstance(block_manager, KVGroupManager) else None
        self.policy = policy
        # KV compression (`kv_press`): None without a press, whose steps then carry none of its fields
        self.press_step: PressStep | None = None
        if press is not None:
            if not isinstance(block_manager, CompactingBlockManager | CompactingGroupManager):
                raise ValueError(f"a KV press needs a CompactingBlockManager or CompactingGroupManager, got "
                                 f"{type(block_manager).__name__}")
            self.press_step = PressStep(press, block_manager)
        self.preemption = preemption or RecomputePreemption()
        # what a preemptive policy's preemptions use: the displaced request simply waits again
        self._recompute = RecomputePreemption()
        policy.bind(block_manager)
        self._now = 0.0
        self.eos_token_ids = frozenset(eos_token_ids)
        # detokenizes outputs with stop strings as they grow; None: such requests are refused
        self.tokenizer = tokenizer
        # prompt token ids must lie in [0, vocab_size) (None: unchecked); one outside would fail the
        # embedding lookup of the whole step, so the request is refused at intake instead
        self.vocab_size = vocab_size
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.counters = SchedulerCounters()
        # blocks the sequence that waits for memory needs (0: none waits), for the memory breakdown
        self._blocked_blocks = 0
        self._groups: dict[Request, SequenceGroup] = {}
        self._pending_aborts: list[Request] = []
        # disaggregated prefill/decode (`handoff`): off unless a fleet's prefill pool turns it on
        self.hands_off = False
        self.handed_off: list[Request] = []
        self.receiving: list[Sequence] = []
        # the steady decode step (`steady`): the last step's rows, reused while nothing changes
        self._init_steady(self._group_tables is None and self.press_step is None)

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or abort it at once with a reason when it can never run."""
        reason = intake_rejection(
            request, self.block_manager, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            has_tokenizer=self.tokenizer is not None, vocab_size=self.vocab_size,
        )
        if reason is not None:
            self.abort(request, reason)
            return
        self._groups[request] = make_group(request, self.eos_token_ids, self.max_model_len)
        if request.params.stop_strings:
            watch_stop_strings(request, self.tokenizer)
        self.waiting.extend(request.seqs)
        self.policy.on_add(request, self._now)

    def abort(self, request: Request, reason: str) -> None:
        request.abort_reason = reason
        request.prompt_hashes = None  # a router's, for one refused at intake: it never reaches the index
        for seq in request.seqs:
            seq.status = SeqStatus.FINISHED  # before `free`: a finished sequence's prefix chain goes with its blocks
            seq.finish_reason = FinishReason.ABORTED
            if self.block_manager.has_blocks(seq):
                self.block_manager.free(seq)
            if seq in self.waiting:
                self.waiting.remove(seq)
            if seq in self.running:
                self.running.remove(seq)
            if seq in self.swapped:
                self.swapped.remove(seq)
            if seq in self.receiving:
                self.receiving.remove(seq)
        if self._groups.pop(request, None) is not None:  # it was queued: the policy knows it
            self.policy.on_finished(request, self._now)
        self.counters.num_aborted += 1
        self._pending_aborts.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._pending_aborts)

    def request_counts(self) -> tuple[int, int]:
        """Requests running (a sequence in the batch) and waiting: every other unfinished one held
        (not yet admitted, preempted, swapped out, or receiving its KV on a decode replica, which
        joins `_groups` only when it arrives). O(running): the running sequences of one request
        (n > 1, beams) count once."""
        running = len({seq.request for seq in self.running})
        return running, len(self._groups) - running + len(self.receiving)

    def stats(self) -> SchedulerStats:
        kv = self.block_manager.stats(self._blocked_blocks)
        return SchedulerStats(len(self.running), len(self.waiting), kv, len(self.swapped))

    # -- schedule --------------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """One step: the token budget filled with running rows (decodes, chunks of prompts in
        progress), swap-ins and new prefills, in `batch_order` (module docstring)."""
        self._blocked_blocks = 0
        self._now = now
        out = SchedulerOutput()
        if self.policy.preemptive and self.waiting:
            self._preempt_for_waiting(out, now)
        budget = StepBudget(self.max_num_batched_tokens, self.chunked_prefill, self.long_prefill_token_threshold)
        if not self._run_steady(out, budget, now):
            self._schedule_queues(out, budget, now)
        out.is_prefill = out.num_decode_rows < len(out.scheduled)
        self.counters.num_swapped_blocks += len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        # the tiers for evicted prefixes: copies this step's evictions and tier hits recorded
        out.blocks_to_offload, out.blocks_to_onload = self.block_manager.prefix_index.take_tier_moves()
        out.aborted, self._pending_aborts = self._pending_aborts, []
        if out.scheduled:
            self.policy.on_scheduled(out, now)
        if self.press_step is not None:
            self.press_step.plan(out)
        self._remember_steady(out)
        return out

    def _schedule_queues(self, out: SchedulerOutput, budget: StepBudget, now: float) -> None:
        """The general step: running rows, swap-ins and admissions in `batch_order`."""
        prefilling: list[list[Sequence]] = []
        decoding: list[list[Sequence]] = []
        for gang in running_gangs(self.running, budget, self.policy, now):
            # a lone sequence with more than its next token to compute has a prompt in progress
            in_prefill = len(gang) == 1 and len(gang[0].token_ids) - gang[0].num_computed_tokens > 1
            (prefilling if in_prefill else decoding).append(gang)
        if self.prefill_first:
            self._run(out, budget, prefilling, now)
            if not self.swapped:
                self._admit(out, budget, now)
            # vLLM V0: without chunks, a step that admits prompts runs nothing else
            if self.chunked_prefill or not out.scheduled:
                self._run(out, budget, decoding, now)
                self._swap_in(out, budget, now)
        else:
            self._run(out, budget, decoding + prefilling, now)
            self._swap_in(out, budget, now)
            if not self.swapped:  # swapped-out requests are served before new ones
                self._admit(out, budget, now)

    def _run(self, out: SchedulerOutput, budget: StepBudget, gangs: list[list[Sequence]], now: float) -> None:
        """Schedule running requests in order: a chunk of each prompt in progress, a token for each
        decoding sequence. A decode that finds no free block preempts the policy's victim among the
        requests not yet scheduled this step (possibly itself)."""
        # once per running sequence per step: lookups hoisted, a lone sequence handled without a generator
        queue = deque(gangs)
        bm, scheduled = self.block_manager, out.scheduled
        while queue:
            gang = queue.popleft()
            seq = gang[0]
            size = len(gang)
            remaining = len(seq.token_ids) - seq.num_computed_tokens
            if not remaining:  # async scheduling: its last token is in flight (`lagged_update`)
                continue
            if size == 1 and remaining > 1:  # a prompt in progress: its blocks exist already
                n = budget.chunk(remaining)
                if n:
                    scheduled.append(self._scheduled(seq, n))
                    budget.tokens -= n
                budget.num_partial += n < remaining
                continue
            if budget.tokens < size:  # waits for a step with room
                continue
            while (copies := grow(bm, gang)) is None:
                victim = self.policy.choose_victim([*(s for g in queue for s in g), *gang], now)
                victim_gang = next(g for g in (*queue, gang) if g[0].request is victim.request)
                self._preempt(victim_gang, out)
                if victim_gang is gang:
                    break
                queue.remove(victim_gang)
            else:
                if copies:
                    out.blocks_to_copy.extend(copies)
                if size == 1:
                    scheduled.append(self._scheduled(seq, 1))
                    # a lone sequence's last prompt token is not a decode
                    out.num_decode_rows += len(seq.token_ids) > seq.num_prompt_tokens
                else:
                    scheduled.extend(self._scheduled(s, 1) for s in gang)
                    out.num_decode_rows += size
                budget.tokens -= size

    def _admit(self, out: SchedulerOutput, budget: StepBudget, now: float) -> None:
        """Admit waiting requests in the policy's order while seats, tokens and blocks allow."""
        if not self.waiting:
            return
        bm = self.block_manager
        num_seats = seats_in_use(self.running)
        admitted: list[Sequence] = []
        for seq in self.policy.order(self.waiting, now):
            if seq.status is not SeqStatus.WAITING:  # admitted with its group, or aborted
                continue
            if budget.tokens <= 0:
                break
            gang = gang_of(seq, SeqStatus.WAITING)
            gang_seats = seats(gang)
            if num_seats + gang_seats > self.max_num_seqs:
                break
            chunked = self.chunked_prefill and len(gang) == 1
            num_tokens = sum(s.num_tokens for s in gang)
            # Unchunked, a gang runs whole. A recomputed group can hold more tokens than a step's
            # budget: it then runs alone rather than never (the budget still bounds every other step).
            if not chunked and num_tokens > budget.tokens and (admitted or num_tokens <= self.max_num_batched_tokens):
                break
            if self.prefix_dedup and len(gang) == 1 and bm.awaits_prefix(seq):
                continue  # another request is computing its next blocks: hit them next step
            if chunked:
                remaining = seq.num_tokens - bm.num_cached_tokens(seq)
                if budget.chunk(remaining) < remaining and budget.num_partial >= self.max_num_partial_prefills:
                    continue  # it would be left part-computed; a shorter prompt may still fit whole
            status = bm.can_allocate(*gang)
            if status is not AllocStatus.OK:
                reason = allocation_rejection(bm, gang, status, idle=not (self.running or admitted))
                if reason is not None:
                    self.abort(seq.request, reason)
                    continue
                self._blocked_blocks = sum(map(bm.admission_blocks, gang))
                break
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
            for s in gang:
                s.num_computed_tokens = bm.allocate(s)
                s.status = SeqStatus.RUNNING
                admitted.append(s)
                self.waiting.remove(s)
                self.running.append(s)
                remaining = s.num_tokens - s.num_computed_tokens
                n = budget.chunk(remaining) if chunked else remaining
                out.scheduled.append(self._scheduled(s, n))
                budget.tokens -= n
                budget.num_partial += n < remaining
            num_seats += gang_seats

    def _preempt_for_waiting(self, out: SchedulerOutput, now: float) -> None:
        """A preemptive policy (vLLM V0's priority preemption): while the best-ranked waiting request
        does not fit, recompute the running request it outranks that the policy would give up first."""
        seq = next((s for s in self.policy.order(self.waiting, now) if s.status is SeqStatus.WAITING), None)
        if seq is None:
            return
        gang = gang_of(seq, SeqStatus.WAITING)
        bm = self.block_manager
        gang_seats = seats(gang)
        while (
            seats_in_use(self.running) + gang_seats > self.max_num_seqs
            or bm.can_allocate(*gang) is AllocStatus.LATER
        ):
            candidates = [s for s in self.running if self.policy.outranks(seq, s, now)]
            if not candidates:
                return
            victim = self.policy.choose_victim(candidates, now).request
            self._preempt([s for s in self.running if s.request is victim], out, self._recompute)

    def _swap_in(self, out: SchedulerOutput, budget: StepBudget, now: float) -> None:
        """Bring swapped-out requests back into this step while blocks, seats and tokens allow; not
        in a step that preempted (it just ran out of blocks)."""
        if not self.swapped or out.preempted:
            return
        bm = self.block_manager
        num_seats = seats_in_use(self.running)
        for seq in self.policy.order(self.swapped, now):
            if seq.status is not SeqStatus.SWAPPED:  # swapped in with its group, or aborted
                continue
            gang = gang_of(seq, SeqStatus.SWAPPED)
            if num_seats + len(gang) > self.max_num_seqs or budget.tokens < len(gang):
                break
            status = bm.can_swap_in(*gang)
            if status is AllocStatus.LATER and self.running:
                self._blocked_blocks = sum(map(bm.admission_blocks, gang))
                break
            if status is not AllocStatus.OK:
                self.abort(seq.request, swap_in_rejection(bm, gang))
                continue
            out.blocks_to_swap_in.extend(bm.swap_in(*gang))
            self.counters.num_swaps_in += 1
            for s in gang:
                self.swapped.remove(s)
                s.status = SeqStatus.RUNNING
                self.running.append(s)
                out.scheduled.append(self._scheduled(s, 1))
            budget.tokens -= len(gang)
            out.num_decode_rows += len(gang)
            num_seats += len(gang)

    def _scheduled(self, seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        # a chunk that leaves part of the prompt uncomputed samples nothing
        done = seq.num_computed_tokens + num_new_tokens == len(seq.token_ids)
        # one sample, no group to ask: the plain request, on every row of every step
        num_samples = 0
        if done:
            num_samples = 1 if seq.request.params.best_of == 1 else self._groups[seq.request].num_samples(seq)
        item = ScheduledSeq(seq, num_new_tokens, self.block_manager.block_table(seq), num_samples)
        if self._group_tables is not None:
            item.group_tables = self._group_tables(seq)
        return item

    def _preempt(self, gang: list[Sequence], out: SchedulerOutput, mode: PreemptionMode | None = None) -> None:
        """Take the blocks of one request's running sequences, all of them (gang preemption), by
        `mode` (the configured preemption mode by default)."""
        if any(s.num_computed_tokens < s.num_tokens - 1 for s in gang):
            mode = self._recompute  # a prompt in progress: little KV to save, and a swap-in would decode
        swapped = (mode or self.preemption).preempt(gang, self.block_manager, out)
        request = gang[0].request
        request.num_preemptions += 1
        self.counters.num_preemptions += 1
        if swapped:
            self.counters.num_swaps_out += 1
        for seq in gang:
            self.running.remove(seq)
            seq.num_preemptions += 1
            if swapped:
                seq.status = SeqStatus.SWAPPED
                self.swapped.append(seq)
            else:
                seq.status = SeqStatus.WAITING
                self.waiting.append(seq)
            out.preempted.append(seq)
