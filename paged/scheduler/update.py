"""Applying an executed step: `update_from_output`, the half of `Scheduler` that sequences grow in.

It advances each scheduled sequence by the tokens the step computed and publishes its full blocks
to the prefix cache; a sequence that sampled takes its token. A lone sequence takes it directly (the
per-token hot path); the sequences of a request with samples or beams hand their tokens to the
request's sequence group, whose update the scheduler applies: fork children off parents' blocks,
append, prune beams, finish the group. Each appended token goes through the stop rules (`stop`),
and a finished sequence's blocks are freed at once. In a disaggregated fleet's prefill pool
(`hands_off`) a sequence that its first token does not end is handed off instead (`handoff`).
"""

from __future__ import annotations

from paged.request import FinishReason, Request, SeqStatus, Sequence
from paged.scheduler.press_step import PressStep
from paged.scheduler.sequence_group import GroupUpdate, SequenceGroup
from paged.scheduler.state import SchedulerState
from paged.scheduler.steady import SteadyRows
from paged.scheduler.stop import check_stop
from paged.step import ExecutorOutput, Samples, SchedulerOutput, TokenLogprobs


class UpdateMixin(SchedulerState):
    """`Scheduler`'s update half (its base class). `Scheduler.__init__` sets the state it changes."""

    hands_off: bool
    press_step: PressStep | None
    _steady: SteadyRows | None
    _steady_out: SchedulerOutput | None

    def update_from_output(self, sched: SchedulerOutput, output: ExecutorOutput, now: float) -> list[Request]:
        """Apply one executed step; returns the requests that finished (or were aborted) in it."""
        self._now = now
        if (sched is self._steady_out and self._steady is not None and not self.hands_off
                and output.logprobs is None and output.top_logprobs is None and not output.prompt_logprobs
                and self.press_step is None):
            return self._update_steady(sched, output, self._steady, now)
        finished = list(sched.aborted)
        samples: dict[Request, list[tuple[Sequence, Samples]]] = {}
        mark_computed = self.block_manager.mark_computed
        eos_token_ids, max_model_len = self.eos_token_ids, self.max_model_len
        hands_off = self.hands_off
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
            # A lone sequence is its own group: one token, no group bookkeeping. The hot path, with
            # `_append` inlined: one more call per token costs measurably here.
            request.token_times.append(now)
            token_id = tokens[0]
            seq.token_ids.append(token_id)
            logprob = logprobs[i][0] if logprobs else 0.0
            seq.cumulative_logprob += logprob
            if seq.logprobs is not None:
                top = tops[i] if tops else None
                seq.logprobs.append((top[0] if top else None) or {token_id: (logprob, 0)})
            if (stop := check_stop(seq, token_id, eos_token_ids, max_model_len)) is not None:
                self._finish(seq, *stop)
                finished.append(self._complete(request))
            elif hands_off:  # a prefill pool's request decodes elsewhere from its first token on
                self._hand_off(seq)
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
        if self.press_step is not None:
            self.press_step.apply(sched, output)
        return finished

    def _update_steady(self, sched: SchedulerOutput, output: ExecutorOutput, steady: SteadyRows,
                       now: float) -> list[Request]:
        """`update_from_output`'s lone-sequence path for a steady step (`steady`): every row one
        computed token and one sampled, its full blocks published only when its step filled one,
        its stop rules asked only when its token or length may stop it (or it has a detokenizer to
        feed or logprobs to keep). Its first token came in an earlier step."""
        finished = list(sched.aborted)
        bm = self.block_manager
        mark_computed, bs = bm.mark_computed, bm.block_size
        publishes = bm.prefix_index.enabled
        for seq, tokens, stops, limit in zip(steady.running, output.sampled, steady.stops, steady.limits,
                                             strict=True):
            seq.num_computed_tokens = computed = seq.num_computed_tokens + 1
            # the step before published every full block: one more is full only at a block's edge
            if not computed % bs and publishes:
                mark_computed(seq)
            seq.request.token_times.append(now)
            token_ids = seq.token_ids
            token_ids.append(token_id := tokens[0])
            if (token_id in stops or len(token_ids) >= limit) and self._steady_stop(seq, token_id):
                finished.append(self._complete(seq.request))
        for request in finished:
            request.finish_time = now
        return finished

    def _steady_stop(self, seq: Sequence, token_id: int) -> bool:
        """A steady row's token that may end it (or feed its detokenizer, or its logprobs): True
        when it did, its sequence finished."""
        if seq.logprobs is not None:
            seq.logprobs.append({token_id: (0.0, 0)})
        stop = check_stop(seq, token_id, self.eos_token_ids, self.max_model_len)
        return stop is not None and self._finish(seq, *stop)

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
        seq.token_ids.append(token_id)
        seq.cumulative_logprob += logprob
        if seq.logprobs is not None:
            seq.logprobs.append(top_logprobs or {token_id: (logprob, 0)})
        if not check_stops:
            return False
        stop = check_stop(seq, token_id, self.eos_token_ids, self.max_model_len)
        return stop is not None and self._finish(seq, *stop)

    def _finish(self, seq: Sequence, reason: FinishReason | None, stop_reason: str | int | None = None) -> bool:
        """End `seq` and free its blocks; `reason` None for a beam that is not an output itself."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self.block_manager.free(seq)
        self.running.remove(seq)
        return True
