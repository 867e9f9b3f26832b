"""Continuous (iteration-level) batching with chunked prefill, and the one place where sequence
state changes.

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
together, and never chunked. `update_from_output` applies what the executor computed and sampled: it
advances sequences, publishes prefix blocks, lets each request's sequence group fork, prune and
finish its sequences, checks stop conditions (EOS, stop tokens, stop strings, length), and frees
what finished.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from paged.config import SchedulerConfig
from paged.detokenizer import IncrementalDetokenizer
from paged.memory import AllocStatus, BlockManager
from paged.request import FinishReason, Request, SeqStatus, Sequence
from paged.scheduler.policy import SchedulingPolicy
from paged.scheduler.preemption import PreemptionMode, RecomputePreemption
from paged.scheduler.sequence_group import GroupUpdate, SequenceGroup, make_group
from paged.step import ExecutorOutput, Samples, ScheduledSeq, SchedulerOutput, SchedulerStats, TokenLogprobs


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    num_aborted: int = 0
    num_swaps_out: int = 0
    num_swaps_in: int = 0
    num_swapped_blocks: int = 0  # blocks moved either way


@dataclass
class _Budget:
    """What is left of one step: tokens, and how many prompts it leaves part-computed."""

    tokens: int
    num_partial: int = 0


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
        self.chunked_prefill = bool(cfg.chunked_prefill)
        self.prefill_first = cfg.batch_order == "prefill-first"
        self.max_num_partial_prefills = int(cfg.max_num_partial_prefills)
        self.long_prefill_token_threshold = int(cfg.long_prefill_token_threshold)
        self.prefix_dedup = bool(cfg.prefix_dedup)
        self.block_manager = block_manager
        self.policy = policy
        self.preemption = preemption or RecomputePreemption()
        # what a preemptive policy's preemptions use: the displaced request simply waits again
        self._recompute = RecomputePreemption()
        policy.bind(block_manager)
        self._now = 0.0
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
        self.policy.on_add(request, self._now)

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
        if self._groups.pop(request, None) is not None:  # it was queued: the policy knows it
            self.policy.on_finished(request, self._now)
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
        """One step: the token budget filled with running rows (decodes, chunks of prompts in
        progress), swap-ins and new prefills, in `batch_order` (module docstring)."""
        self._blocked_blocks = 0
        self._now = now
        out = SchedulerOutput()
        if self.policy.preemptive and self.waiting:
            self._preempt_for_waiting(out, now)
        budget = _Budget(self.max_num_batched_tokens)
        prefilling: list[list[Sequence]] = []
        decoding: list[list[Sequence]] = []
        for gang in self._running_gangs(budget, now):
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
        out.is_prefill = out.num_decode_rows < len(out.scheduled)
        self.counters.num_swapped_blocks += len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        out.aborted, self._pending_aborts = self._pending_aborts, []
        if out.scheduled:
            self.policy.on_scheduled(out, now)
        return out

    @staticmethod
    def _gang(seq: Sequence, status: SeqStatus) -> list[Sequence]:
        """`seq` and the other sequences of its request in the same state: they move together."""
        return [seq, *(s for s in seq.request.seqs if s.status is status and s is not seq)]

    def _running_gangs(self, budget: _Budget, now: float) -> list[list[Sequence]]:
        """The running sequences by request: in the policy's order when the budget cannot hold all
        their rows (who goes first then decides who runs), else in admission order."""
        gangs: dict[Request, list[Sequence]] = {}
        need = 0
        for seq in self.running:
            gangs.setdefault(seq.request, []).append(seq)
            need += len(seq.token_ids) - seq.num_computed_tokens
        if need <= budget.tokens or len(gangs) <= 1:
            return list(gangs.values())
        return [gangs[s.request] for s in self.policy.order([g[0] for g in gangs.values()], now)]

    @staticmethod
    def _seats(gang: list[Sequence]) -> int:
        """Batch seats a request holds: one not yet forked takes those its samples or beams will fill
        (vLLM's max_num_running_seqs), so forking never overfills the batch."""
        return max(len(gang), gang[0].request.params.best_of) if len(gang[0].request.seqs) == 1 else len(gang)

    def _seats_in_use(self) -> int:
        return len(self.running) + sum(
            s.request.params.best_of - 1 for s in self.running if len(s.request.seqs) == 1
        )

    def _chunk(self, remaining: int, budget: _Budget) -> int:
        """Tokens of a prompt (or recomputed sequence) with `remaining` uncomputed ones to run now."""
        if not self.chunked_prefill:
            return remaining
        n = min(remaining, budget.tokens)
        return min(n, self.long_prefill_token_threshold) if self.long_prefill_token_threshold else n

    def _run(self, out: SchedulerOutput, budget: _Budget, gangs: list[list[Sequence]], now: float) -> None:
        """Schedule running requests in order: a chunk of each prompt in progress, a token for each
        decoding sequence. A decode that finds no free block preempts the policy's victim among the
        requests not yet scheduled this step (possibly itself)."""
        queue = deque(gangs)
        while queue:
            gang = queue.popleft()
            seq = gang[0]
            remaining = seq.num_tokens - seq.num_computed_tokens
            if len(gang) == 1 and remaining > 1:  # a prompt in progress: its blocks exist already
                n = self._chunk(remaining, budget)
                if n:
                    out.scheduled.append(self._scheduled(seq, n))
                    budget.tokens -= n
                budget.num_partial += n < remaining
                continue
            if budget.tokens < len(gang):  # waits for a step with room
                continue
            while (copies := self._grow(gang)) is None:
                victim = self.policy.choose_victim([*(s for g in queue for s in g), *gang], now)
                victim_gang = next(g for g in (*queue, gang) if g[0].request is victim.request)
                self._preempt(victim_gang, out)
                if victim_gang is gang:
                    break
                queue.remove(victim_gang)
            else:
                out.blocks_to_copy.extend(copies)
                out.scheduled.extend(self._scheduled(s, 1) for s in gang)
                budget.tokens -= len(gang)
                # a lone sequence's last prompt token is not a decode
                out.num_decode_rows += len(gang) if len(gang) > 1 or seq.num_output_tokens else 0

    def _admit(self, out: SchedulerOutput, budget: _Budget, now: float) -> None:
        """Admit waiting requests in the policy's order while seats, tokens and blocks allow."""
        if not self.waiting:
            return
        bm = self.block_manager
        num_seats = self._seats_in_use()
        admitted: list[Sequence] = []
        for seq in self.policy.order(self.waiting, now):
            if seq.status is not SeqStatus.WAITING:  # admitted with its group, or aborted
                continue
            if budget.tokens <= 0:
                break
            gang = self._gang(seq, SeqStatus.WAITING)
            seats = self._seats(gang)
            if num_seats + seats > self.max_num_seqs:
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
                if self._chunk(remaining, budget) < remaining and budget.num_partial >= self.max_num_partial_prefills:
                    continue  # it would be left part-computed; a shorter prompt may still fit whole
            status = self._admission_status(gang, idle=not (self.running or admitted))
            if status is AllocStatus.NEVER:
                continue
            if status is AllocStatus.LATER:
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
                n = self._chunk(remaining, budget) if chunked else remaining
                out.scheduled.append(self._scheduled(s, n))
                budget.tokens -= n
                budget.num_partial += n < remaining
            num_seats += seats

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

    def _preempt_for_waiting(self, out: SchedulerOutput, now: float) -> None:
        """A preemptive policy (vLLM V0's priority preemption): while the best-ranked waiting request
        does not fit, recompute the running request it outranks that the policy would give up first."""
        seq = next((s for s in self.policy.order(self.waiting, now) if s.status is SeqStatus.WAITING), None)
        if seq is None:
            return
        gang = self._gang(seq, SeqStatus.WAITING)
        bm = self.block_manager
        seats = self._seats(gang)
        while self._seats_in_use() + seats > self.max_num_seqs or bm.can_allocate(*gang) is AllocStatus.LATER:
            candidates = [s for s in self.running if self.policy.outranks(seq, s, now)]
            if not candidates:
                return
            victim = self.policy.choose_victim(candidates, now).request
            self._preempt([s for s in self.running if s.request is victim], out, self._recompute)

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

    def _swap_in(self, out: SchedulerOutput, budget: _Budget, now: float) -> None:
        """Bring swapped-out requests back into this step while blocks, seats and tokens allow; not
        in a step that preempted (it just ran out of blocks)."""
        if not self.swapped or out.preempted:
            return
        bm = self.block_manager
        num_seats = self._seats_in_use()
        for seq in self.policy.order(self.swapped, now):
            if seq.status is not SeqStatus.SWAPPED:  # swapped in with its group, or aborted
                continue
            gang = self._gang(seq, SeqStatus.SWAPPED)
            if num_seats + len(gang) > self.max_num_seqs or budget.tokens < len(gang):
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
            budget.tokens -= len(gang)
            out.num_decode_rows += len(gang)
            num_seats += len(gang)

    def _scheduled(self, seq: Sequence, num_new_tokens: int) -> ScheduledSeq:
        # a chunk that leaves part of the prompt uncomputed samples nothing
        done = seq.num_computed_tokens + num_new_tokens == len(seq.token_ids)
        num_samples = self._groups[seq.request].num_samples(seq) if done else 0
        return ScheduledSeq(seq, num_new_tokens, self.block_manager.block_table(seq), num_samples)

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

    # -- update ----------------------------------------------------------------------------------

    def update_from_output(self, sched: SchedulerOutput, output: ExecutorOutput, now: float) -> list[Request]:
        """Apply one executed step; returns the requests that finished (or were aborted) in it."""
        self._now = now
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
                group_samples = samples.get(request)
                if group_samples is None:
                    # one timestamp per step, however many of the request's sequences sampled in it
                    samples[request] = group_samples = []
                    request.token_times.append(now)
                group_samples.append((seq, output.samples(i)))
                continue
            # a lone sequence is its own group: one token, no group bookkeeping (the hot path)
            request.token_times.append(now)
            top = tops[i] if tops else None
            if self._append(seq, tokens[0], logprobs[i][0] if logprobs else 0.0, top[0] if top else None):
                finished.append(self._complete(request))
        for seq_id, prompt_logprobs in output.prompt_logprobs.items():
            # chunk after chunk; a recomputed prompt's are not kept twice
            request = next(item.seq.request for item in sched.scheduled if item.seq.seq_id == seq_id)
            collected = request.prompt_logprobs or []
            if len(collected) < request.num_prompt_tokens:
                request.prompt_logprobs = collected + prompt_logprobs
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
        self.policy.on_finished(request, self._now)
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
