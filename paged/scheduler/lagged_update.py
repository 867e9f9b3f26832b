"""Async scheduling's update (`scheduler.async_scheduling`): a step's tokens applied one step late.

Under async scheduling the engine launches step N+1 before it reads step N's tokens
(`paged.engine.async_step`). So that N+1 can be scheduled, `commit_scheduled` applies what is known
of step N as soon as it is launched: each row's tokens count as computed, and a row that samples
gives its sequence a placeholder token, -(1 + r) for the step's r-th sampling row, which the next
step's inputs read from the device (vLLM V1's output placeholders, SGLang's future token ids). A
token that takes a sequence to its length limit (`max_tokens`, `max_model_len`) ends it whatever
it is: that sequence gets no placeholder, so it has nothing left to compute and the scheduler
leaves it out of the steps until its token is read; it keeps its blocks and seat until then.

`update_lagged` runs when step N's tokens reach the host: each placeholder becomes its token and
goes through the stop rules, as `update_from_output` would have applied it. A sequence that stops
there may already be in step N+1: it is finished (its blocks freed) now, and its row of N+1 is
skipped when N+1 is applied. One that N+1's schedule preempted takes its token where it waits.
Full blocks are published to the prefix cache only up to what step N computed, never what N+1 is
still computing. Only requests whose tokens can lag (`paged.step.tokens_can_lag`) are in such a
step: the others' steps run synchronously, through `update_from_output`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from paged.request import FinishReason, Request, SeqStatus, Sequence
from paged.scheduler.state import SchedulerState
from paged.scheduler.stop import check_stop
from paged.step import ExecutorOutput, SchedulerOutput


@dataclass(frozen=True, slots=True)
class Committed:
    """Per scheduled row of a committed step: the sequence's computed tokens once the step is done,
    where its token goes in its token ids (-1: it samples nothing), and its preemptions when
    the step was launched (one more since: a later step took its blocks)."""

    computed: list[int]
    positions: list[int]
    preemptions: list[int]


class LaggedUpdateMixin(SchedulerState):
    """`Scheduler`'s async half (its base class). `Scheduler.__init__` sets the state it changes."""

    _complete: Callable[[Request], Request]  # `UpdateMixin._complete`

    def commit_scheduled(self, sched: SchedulerOutput) -> Committed:
        """Apply a launched step as far as it is known before its tokens are read."""
        computed, positions, preemptions = [], [], []
        row = 0
        for item in sched.scheduled:
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            computed.append(seq.num_computed_tokens)
            preemptions.append(seq.num_preemptions)
            if not item.num_samples:
                positions.append(-1)
                continue
            assert item.num_samples == 1, "a step with a sequence group does not lag"
            num_tokens = len(seq.token_ids)
            positions.append(num_tokens)
            # with its token, fewer than max_tokens outputs and max_model_len tokens: it goes on
            if num_tokens + 1 < min(seq.num_prompt_tokens + seq.request.params.max_tokens, self.max_model_len):
                seq.token_ids.append(-1 - row)
            row += 1
        return Committed(computed, positions, preemptions)

    def update_lagged(
        self, sched: SchedulerOutput, output: ExecutorOutput, committed: Committed, now: float
    ) -> list[Request]:
        """Apply a committed step's tokens; returns the requests that finished (or were aborted) in it."""
        self._now = now
        finished = list(sched.aborted)
        eos_token_ids, max_model_len = self.eos_token_ids, self.max_model_len
        rows = zip(sched.scheduled, output.sampled, committed.computed, committed.positions, committed.preemptions,
                   strict=True)
        for item, tokens, computed, position, preemptions in rows:
            seq = item.seq
            if seq.is_finished:  # aborted since, or ended by the step before
                continue
            if seq.num_preemptions == preemptions:
                self._publish(seq, computed)
            if position < 0:
                continue
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            request.token_times.append(now)
            token_id = tokens[0]
            token_ids = seq.token_ids
            later = token_ids[position + 1 :]  # the placeholder of a step launched since
            del token_ids[position:]
            token_ids.append(token_id)
            stop = check_stop(seq, token_id, eos_token_ids, max_model_len)
            if stop is None:
                token_ids.extend(later)
                continue
            self._retire(seq, *stop)
            finished.append(self._complete(request))
        for request in finished:
            request.finish_time = now
        return finished

    def _publish(self, seq: Sequence, computed: int) -> None:
        """`mark_computed` as of the step being applied: the sequence's count already includes a
        step launched since, whose KV is not all written yet."""
        ahead = seq.num_computed_tokens
        seq.num_computed_tokens = computed
        try:
            self.block_manager.mark_computed(seq)
        finally:
            seq.num_computed_tokens = ahead

    def _retire(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None) -> None:
        """End `seq` wherever the steps launched since left it (running, or preempted to either
        queue) and free its blocks."""
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
                break
        seq.status = SeqStatus.FINISHED  # before `free`: a finished sequence's prefix chain goes with its blocks
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if self.block_manager.has_blocks(seq):
            self.block_manager.free(seq)
