"""Continuous (iteration-level) batching, prefill-first as in vLLM V0, and the one place where
sequence state changes.

Each step is either a prefill step (admit waiting sequences while the token, sequence and block
budgets allow) or, when nothing can be admitted, a decode step over every running sequence. When a
running sequence cannot get a slot for its next token, the policy picks a victim and the preemption
mode takes its blocks: recomputed, it rejoins the waiting queue; swapped out, the swapped queue,
which is served first (as in vLLM V0: no prefill while a sequence is swapped out, and swap-ins join
a decode step in which nothing was preempted). A request's sequences (samples, beams) are gang
scheduled, as the paper's sequence groups: admitted, preempted and swapped in all together.
`update_from_output` applies what the executor computed and sampled: it advances sequences,
publishes prefix blocks, lets each request's sequence group fork, prune and finish its sequences,
checks stop conditions (EOS, stop tokens, stop strings, length), and frees what finished.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from paged.config import SchedulerConfig
from paged.detokenizer import IncrementalDetokenizer
from paged.executor.output import ExecutorOutput
from paged.memory import AllocStatus, BlockManager, KVStats
from paged.model.sampler import Samples, TokenLogprobs
from paged.request import FinishReason, Request, SeqStatus, Sequence
from paged.scheduler.output import ScheduledSeq, SchedulerOutput
from paged.scheduler.policy import SchedulingPolicy
from paged.scheduler.preemption import PreemptionMode, RecomputePreemption
from paged.scheduler.sequence_group import GroupUpdate, SequenceGroup, make_group


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
        tokenizer: Any = None,
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
        # detokenizes outputs with stop strings as they grow; None: such requests are refused
        self.tokenizer = tokenizer
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
        params = request.params
        self._groups[request] = make_group(request, self.eos_token_ids, self.max_model_len)
        if params.stop_strings:
            for seq in request.seqs:
                seq.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                    stop=params.stop_strings, include_stop_str_in_output=params.include_stop_str_in_output,
                )
        self.waiting.extend(request.seqs)

    def _rejection(self, request: Request) -> str | None:
        if request.abort_reason is not None:
            return request.abort_reason
        params, num_prompt = request.params, request.num_prompt_tokens
        if num_prompt == 0:
            return "empty prompt"
        if num_prompt > self.max_model_len:
            return f"prompt has {num_prompt} tokens, more than max_model_len={self.max_model_len}"
        if num_prompt + params.max_tokens > self.max_model_len:
            # what vLLM's server answers: nothing is silently cut short
            return (
                f"prompt ({num_prompt} tokens) + max_tokens ({params.max_tokens}) = {num_prompt + params.max_tokens} "
                f"tokens, more than max_model_len={self.max_model_len}; max_tokens <= "
                f"{self.max_model_len - num_prompt} fits"
            )
        if params.best_of > self.max_num_seqs:
            what = "beam width" if params.use_beam_search else "best_of"
            return f"{what} {params.best_of} needs more sequences than max_num_seqs={self.max_num_seqs}"
        if params.stop_strings and self.tokenizer is None:
            return "stop strings need a tokenizer, and this executor has none (use stop_token_ids)"
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

    @staticmethod
    def _gang(seq: Sequence, status: SeqStatus) -> list[Sequence]:
        """`seq` and the other sequences of its request in the same state: they move together."""
        return [seq, *(s for s in seq.request.seqs if s.status is status and s is not seq)]

    def _schedule_prefills(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput(is_prefill=True)
        if not self.waiting:
            return out
        token_budget = self.max_num_batched_tokens
        num_seats = len(self.running)
        admitted: list[Sequence] = []
        for seq in self.policy.order(self.waiting, now):
            if seq.status is not SeqStatus.WAITING:  # admitted with its group, or aborted
                continue
            gang = self._gang(seq, SeqStatus.WAITING)
            num_tokens = sum(s.num_tokens for s in gang)
            # a request not yet forked takes the seats its samples or beams will fill (vLLM's
            # max_num_running_seqs), so forking never overfills the batch
            seats = max(len(gang), seq.request.params.best_of) if len(seq.request.seqs) == 1 else len(gang)
            # A recomputed group can hold more tokens than a step's budget: it then runs alone
            # rather than never (the budget still bounds every other prefill step).
            over_budget = num_tokens > token_budget and (admitted or num_tokens <= self.max_num_batched_tokens)
            if num_seats + seats > self.max_num_seqs or over_budget:
                break
            status = self._admission_status(gang, idle=not (self.running or admitted))
            if status is AllocStatus.NEVER:
                continue
            if status is AllocStatus.LATER:
                self._blocked_blocks = sum(map(self.block_manager.admission_blocks, gang))
                break
            if seq.request.first_scheduled_time is None:
                seq.request.first_scheduled_time = now
            for s in gang:
                s.num_computed_tokens = self.block_manager.allocate(s)
                s.status = SeqStatus.RUNNING
                admitted.append(s)
                out.scheduled.append(self._scheduled(s, s.num_tokens - s.num_computed_tokens))
            token_budget -= num_tokens
            num_seats += seats
        for seq in admitted:
            self.waiting.remove(seq)
        self.running.extend(admitted)
        return out

    def _admission_status(self, gang: list[Sequence], *, idle: bool) -> AllocStatus:
        """OK or LATER; NEVER once the request is aborted with the reason. With nothing running
        (`idle`) nothing will free blocks, so LATER is NEVER too."""
        bm = self.block_manager
        status = bm.can_allocate(*gang)
        required = sum(map(bm.admission_blocks, gang))
        needs = f"needs {required} blocks for {sum(s.num_tokens for s in gang)} tokens but"
        request = gang[0].request
        if status is AllocStatus.NEVER and required > bm.allocator.max_allocation < bm.num_total_blocks:
            self.abort(
                request,
                f"{needs} the largest contiguous extent the allocator can give is "
                f"{bm.allocator.max_allocation} blocks",
            )
        elif status is AllocStatus.NEVER:
            self.abort(request, f"{needs} the cache has {bm.num_total_blocks} blocks (watermark {bm.watermark_blocks})")
        elif status is AllocStatus.LATER and idle:
            status = AllocStatus.NEVER
            self.abort(
                request,
                f"{needs} with nothing running only {bm.allocator.num_free_blocks} of the cache's "
                f"{bm.num_total_blocks} blocks are free",
            )
        return status

    def _schedule_decodes(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput(is_prefill=False)
        gangs: dict[Request, list[Sequence]] = {}
        for seq in self.running:
            gangs.setdefault(seq.request, []).append(seq)
        queue = deque(gangs.values())
        while queue:
            gang = queue.popleft()
            while (copies := self._grow(gang)) is None:
                victim = self.policy.choose_victim([*(s for g in queue for s in g), *gang], now)
                victim_gang = gangs[victim.request]
                self._preempt(victim_gang, out)
                if victim_gang is gang:
                    break
                queue.remove(victim_gang)
            else:
                out.blocks_to_copy.extend(copies)
                out.scheduled.extend(self._scheduled(seq, 1) for seq in gang)
        return out

    def _grow(self, gang: list[Sequence]) -> list[tuple[int, int]] | None:
        """A slot for each sequence's next token: the copy-on-write copies to make first, or None
        (nothing changed) when the free blocks do not suffice."""
        bm = self.block_manager
        if len(gang) == 1:  # checks and grows in one pass
            return bm.try_append_slots(gang[0])
        # A group checks first: once one of its sequences has grown (its copy-on-write targets not
        # yet copied), the group could no longer be swapped out whole.
        if not bm.can_append_slots(*gang):
            return None
        return [copy for seq in gang for copy in bm.append_slots(seq)]

    def _schedule_swap_ins(self, out: SchedulerOutput, now: float) -> None:
        """Bring swapped-out requests back into this decode step while blocks and seats allow."""
        bm = self.block_manager
        for seq in self.policy.order(self.swapped, now):
            if seq.status is not SeqStatus.SWAPPED:  # swapped in with its group, or aborted
                continue
            gang = self._gang(seq, SeqStatus.SWAPPED)
            if len(self.running) + len(gang) > self.max_num_seqs:
                break
            status = bm.can_swap_in(*gang)
            if status is AllocStatus.LATER and self.running:
                self._blocked_blocks = sum(map(bm.admission_blocks, gang))
                break
            if status is not AllocStatus.OK:
                needed = sum(map(bm.admission_blocks, gang))
                self.abort(seq.request, f"needs {needed} blocks to swap back in; the cache of {bm.num_total_blocks} "
                                        "blocks cannot give them even with nothing running")
                continue
            out.blocks_to_swap_in.extend(bm.swap_in(*gang))
            self.counters.num_swaps_in += 1
            for s in gang:
                self.swapped.remove(s)
                s.status = SeqStatus.RUNNING
                self.running.append(s)
                out.scheduled.append(self._scheduled(s, 1))

    def _scheduled(self, seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        num_samples = self._groups[seq.request].num_samples(seq)
        return ScheduledSeq(seq, num_new_tokens, self.block_manager.block_table(seq), num_samples)

    def _preempt(self, gang: list[Sequence], out: SchedulerOutput) -> None:
        """Take the blocks of one request's running sequences, all of them (gang preemption)."""
        swapped = self.preemption.preempt(gang, self.block_manager, out)
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

    # -- update ----------------------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, output: ExecutorOutput, now: float) -> list[Request]:
        """Apply one executed step; returns the requests that finished (or were aborted) in it."""
        finished = list(sched.aborted)
        samples: dict[Request, list[tuple[Sequence, Samples]]] = {}
        mark_computed = self.block_manager.mark_computed
        logprobs, tops = output.logprobs, output.top_logprobs
        for i, (item, tokens) in enumerate(zip(sched.scheduled, output.sampled, strict=True)):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            mark_computed(seq)
            if not tokens:
                continue
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            if request.params.best_of > 1:
                samples.setdefault(request, []).append((seq, output.samples(i)))
                continue
            # a lone sequence is its own group: one token, no group bookkeeping (the hot path)
            top = tops[i] if tops else None
            if self._append(seq, tokens[0], logprobs[i][0] if logprobs else 0.0, top[0] if top else None):
                finished.append(self._complete(request))
        for seq_id, prompt_logprobs in output.prompt_logprobs.items():
            request = next(item.seq.request for item in sched.scheduled if item.seq.seq_id == seq_id)
            if request.prompt_logprobs is None:
                request.prompt_logprobs = prompt_logprobs
        for request, group_samples in samples.items():
            group = self._groups[request]
            # a group can only finish when one of its sequences does
            if self._apply(request, group, group.process(group_samples)) and group.is_finished:
                finished.append(self._complete(request))
        for request in finished:
            request.finish_time = now
        return finished

    def _complete(self, request: Request) -> Request:
        request.completions = self._groups.pop(request).completions()
        return request

    def _apply(self, request: Request, group: SequenceGroup, update: GroupUpdate) -> bool:
        """Fork, append, prune and finish; True when a sequence finished."""
        finished = False
        checks = group.checks_stops
        for parent, token in update.forks:
            child = parent.fork(request.next_seq_index())
            self.block_manager.fork(parent, child)
            request.seqs.append(child)
            self.running.append(child)
            finished |= self._append(child, *token, check_stops=checks)
        for seq, token in update.appends:
            finished |= self._append(seq, *token, check_stops=checks)
        for seq in update.prunes:
            self._finish(seq, None)
            request.seqs.remove(seq)
        if update.done:
            for seq in request.seqs:
                if not seq.is_finished:
                    self._finish(seq, None)
            finished = True
        return finished

    def _append(
        self, seq: Sequence, token_id: int, logprob: float, top_logprobs: TokenLogprobs | None,
        check_stops: bool = True,
    ) -> bool:
        """Extend `seq` by one token; True when that finishes it."""
        tokens = seq.token_ids
        tokens.append(token_id)
        seq.cumulative_logprob += logprob
        if seq.logprobs is not None:
            seq.logprobs.append(top_logprobs or {token_id: (logprob, 0)})
        if not check_stops:
            return False
        params = seq.request.params
        num_output = len(tokens) - seq.num_prompt_tokens
        # vLLM: no stop condition but length counts before min_tokens (the sampler bans stop tokens too)
        past_min = num_output >= params.min_tokens
        stop = seq.detokenizer.append(token_id, check_stop=past_min) if seq.detokenizer is not None else None
        if past_min:
            if token_id in params.stop_token_ids:
                return self._finish(seq, FinishReason.STOP, token_id)
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return self._finish(seq, FinishReason.STOP)
            if stop is not None:
                return self._finish(seq, FinishReason.STOP, stop)
        if num_output >= params.max_tokens or len(tokens) >= self.max_model_len:
            return self._finish(seq, FinishReason.LENGTH)
        return False

    def _finish(self, seq: Sequence, reason: FinishReason | None, stop_reason: str | int | None = None) -> bool:
        """End `seq` and free its blocks; `reason` None for a beam that is not an output itself."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.free(seq)
        self.running.remove(seq)
        return True
