"""Continuous (iteration-level) batching, prefill-first as in vLLM V0, and the one place where
sequence state changes.

Each step is either a prefill step (admit waiting sequences while the token, sequence and block
budgets allow) or, when nothing can be admitted, a decode step over every running sequence. When a
running sequence cannot get a slot for its next token, the policy picks a victim and the preemption
mode takes its blocks: recomputed, it rejoins the waiting queue; swapped out, the swapped queue,
which is served first (as in vLLM V0: no prefill while a sequence is swapped out, and swap-ins join
a decode step in which nothing was preempted). `update_from_output` applies what the executor
computed and sampled: it advances sequences, publishes prefix blocks, lets each request's sequence
group fork its samples, checks stop conditions, and finishes and frees sequences.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from paged.config import SchedulerConfig
from paged.executor.output import ExecutorOutput
from paged.memory import AllocStatus, BlockManager, KVStats
from paged.request import FinishReason, Request, SeqStatus, Sequence
from paged.scheduler.output import ScheduledSeq, SchedulerOutput
from paged.scheduler.policy import SchedulingPolicy
from paged.scheduler.preemption import PreemptionMode, RecomputePreemption
from paged.scheduler.sequence_group import GroupUpdate, ParallelSampling, SequenceGroup


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    num_aborted: int = 0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    num_swapped_blocks: int = 0  # blocks moved either way


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv: KVStats
    num_swapped: int = 0


class Scheduler:
    def __init__(
        self,
        cfg: SchedulerConfig,
        block_manager: BlockManager,
        policy: SchedulingPolicy,
        *,
        preemption: PreemptionMode | None = None,
        eos_token_ids: Collection[int] = (),
    ) -> None:
        self.cfg = cfg
        # plain ints: the per-token checks must not pay for a config-node lookup
        self.max_model_len = int(cfg.max_model_len)
        self.max_num_seqs = int(cfg.max_num_seqs)
        self.max_num_batched_tokens = int(cfg.max_num_batched_tokens)
        self.block_manager = block_manager
        self.policy = policy
        self.preemption = preemption or RecomputePreemption()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.counters = SchedulerCounters()
        # blocks the sequence that waits for memory needs (0: none waits), for the memory breakdown
        self._blocked_blocks = 0
        self._groups: dict[Request, SequenceGroup] = {}
        self._pending_aborts: list[Request] = []

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or abort it at once with a reason when it can never run."""
        reason = self._rejection(request)
        if reason is not None:
            self.abort(request, reason)
            return
        self._groups[request] = ParallelSampling(request)
        self.waiting.extend(request.seqs)

    def _rejection(self, request: Request) -> str | None:
        if request.abort_reason is not None:
            return request.abort_reason
        if request.num_prompt_tokens == 0:
            return "empty prompt"
        if request.num_prompt_tokens > self.max_model_len:
            return (
                f"prompt has {request.num_prompt_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )
        return self.block_manager.rejection(request)

    def abort(self, request: Request, reason: str) -> None:
        request.abort_reason = reason
        for seq in request.seqs:
            if self.block_manager.has_blocks(seq):
                self.block_manager.free(seq)
            if seq in self.waiting:
                self.waiting.remove(seq)
            if seq in self.running:
                self.running.remove(seq)
            if seq in self.swapped:
                self.swapped.remove(seq)
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = FinishReason.ABORTED
        self._groups.pop(request, None)
        self.counters.num_aborted += 1
        self._pending_aborts.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self._pending_aborts)

    def stats(self) -> SchedulerStats:
        kv = self.block_manager.stats(self._blocked_blocks)
        return SchedulerStats(len(self.running), len(self.waiting), kv, len(self.swapped))

    # -- schedule --------------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        self._blocked_blocks = 0
        out = SchedulerOutput() if self.swapped else self._schedule_prefills(now)
        if out.is_empty:
            out = self._schedule_decodes(now)
            if self.swapped and not out.preempted:
                self._schedule_swap_ins(out, now)
        self.counters.num_swapped_blocks += len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        out.aborted, self._pending_aborts = self._pending_aborts, []
        return out

    def _schedule_prefills(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput(is_prefill=True)
        if not self.waiting:
            return out
        token_budget = self.max_num_batched_tokens
        admitted: list[Sequence] = []
        for seq in self.policy.order(self.waiting, now):
            if len(self.running) + len(admitted) >= self.max_num_seqs or seq.num_tokens > token_budget:
                break
            status = self._admission_status(seq, idle=not (self.running or admitted))
            if status is AllocStatus.NEVER:
                continue
            if status is AllocStatus.LATER:
                self._blocked_blocks = self.block_manager.admission_blocks(seq)
                break
            seq.num_computed_tokens = self.block_manager.allocate(seq)
            seq.status = SeqStatus.RUNNING
            token_budget -= seq.num_tokens
            admitted.append(seq)
            out.scheduled.append(self._scheduled(seq, seq.num_tokens - seq.num_computed_tokens))
        for seq in admitted:
            self.waiting.remove(seq)
        self.running.extend(admitted)
        return out

    def _admission_status(self, seq: Sequence, *, idle: bool) -> AllocStatus:
        """OK or LATER; NEVER once `seq`'s request is aborted with the reason. With nothing running
        (`idle`) nothing will free blocks, so LATER is NEVER too."""
        bm = self.block_manager
        status = bm.can_allocate(seq)
        required = bm.admission_blocks(seq)
        needs = f"needs {required} blocks for {seq.num_tokens} tokens but"
        if status is AllocStatus.NEVER and required > bm.allocator.max_allocation < bm.num_total_blocks:
            self.abort(
                seq.request,
                f"{needs} the largest contiguous extent the allocator can give is "
                f"{bm.allocator.max_allocation} blocks",
            )
        elif status is AllocStatus.NEVER:
            self.abort(
                seq.request,
                f"{needs} the cache has {bm.num_total_blocks} blocks (watermark {bm.watermark_blocks})",
            )
        elif status is AllocStatus.LATER and idle:
            status = AllocStatus.NEVER
            self.abort(
                seq.request,
                f"{needs} with nothing running only {bm.allocator.num_free_blocks} of the cache's "
                f"{bm.num_total_blocks} blocks are free",
            )
        return status

    def _schedule_decodes(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput(is_prefill=False)
        queue = deque(self.running)
        try_append = self.block_manager.try_append_slots
        while queue:
            seq = queue.popleft()
            while (copies := try_append(seq)) is None:
                victim = self.policy.choose_victim([*queue, seq], now)
                self._preempt(victim, out)
                if victim is seq:
                    break
                queue.remove(victim)
            else:
                if copies:
                    out.blocks_to_copy.extend(copies)
                out.scheduled.append(self._scheduled(seq, 1))
        return out

    def _schedule_swap_ins(self, out: SchedulerOutput, now: float) -> None:
        """Bring swapped-out sequences back into this decode step while blocks and seats allow."""
        bm = self.block_manager
        for seq in self.policy.order(self.swapped, now):
            if len(self.running) >= self.max_num_seqs:
                break
            status = bm.can_swap_in(seq)
            if status is AllocStatus.LATER and self.running:
                self._blocked_blocks = bm.admission_blocks(seq)
                break
            if status is not AllocStatus.OK:
                self.abort(seq.request, f"needs {bm.admission_blocks(seq)} blocks to swap back in; the cache of "
                                        f"{bm.num_total_blocks} blocks cannot give them even with nothing running")
                continue
            out.blocks_to_swap_in.extend(bm.swap_in(seq))
            self.swapped.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.counters.num_swaps_in += 1
            out.scheduled.append(self._scheduled(seq, 1))

    def _scheduled(self, seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        num_samples = self._groups[seq.request].num_samples(seq)
        return ScheduledSeq(seq, num_new_tokens, self.block_manager.block_table(seq), num_samples)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        swapped = self.preemption.preempt(seq, self.block_manager, out)
        self.running.remove(seq)
        seq.num_preemptions += 1
        seq.request.num_preemptions += 1
        self.counters.num_preemptions += 1
        if swapped:
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
            self.counters.num_swaps_out += 1
        else:
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)
        out.preempted.append(seq)

    # -- update ----------------------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, output: ExecutorOutput, now: float) -> list[Request]:
        """Apply one executed step; returns the requests that finished (or were aborted) in it."""
        finished = list(sched.aborted)
        samples: dict[Request, list[tuple[Sequence, list[int]]]] = {}
        mark_computed = self.block_manager.mark_computed
        for item, tokens in zip(sched.scheduled, output.sampled, strict=True):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            mark_computed(seq)
            if tokens:
                samples.setdefault(seq.request, []).append((seq, tokens))
        for request, group_samples in samples.items():
            if request.first_token_time is None:
                request.first_token_time = now
            group = self._groups[request]
            # a group can only finish when one of its sequences does
            if self._apply(request, group.process(group_samples)) and group.is_finished:
                del self._groups[request]
                finished.append(request)
        for request in finished:
            request.finish_time = now
        return finished

    def _apply(self, request: Request, update: GroupUpdate) -> bool:
        """Fork and append; True when a sequence finished."""
        finished = False
        for parent, token in update.forks:
            child = parent.fork(len(request.seqs))
            self.block_manager.fork(parent, child)
            request.seqs.append(child)
            self.running.append(child)
            finished |= self._append(child, token)
        for seq, token in update.appends:
            finished |= self._append(seq, token)
        return finished

    def _append(self, seq: Sequence, token: int) -> bool:
        """Extend `seq` by `token`; True when that finishes it."""
        tokens = seq.token_ids
        tokens.append(token)
        params = seq.request.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            self._finish(seq, FinishReason.STOP)
            return True
        if len(tokens) - seq.num_prompt_tokens >= params.max_tokens or len(tokens) >= self.max_model_len:
            self._finish(seq, FinishReason.LENGTH)
            return True
        return False

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        self.running.remove(seq)
