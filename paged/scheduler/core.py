"""Continuous (iteration-level) batching, prefill-first as in vLLM V0, with recompute preemption.

Each step is either a prefill step (admit waiting sequences while the token, sequence and block
budgets allow) or, when nothing can be admitted, a decode step over every running sequence. When a
running sequence cannot get a slot for its next token, the policy picks a victim whose blocks are
freed; it rejoins the waiting queue and its generated tokens are recomputed as part of its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.config import SchedulerConfig
from paged.memory import AllocStatus, BlockManager
from paged.request import FinishReason, Request, SeqStatus, Sequence
from paged.scheduler.output import ScheduledSeq, SchedulerOutput
from paged.scheduler.policy import SchedulingPolicy


@dataclass
class SchedulerCounters:
    num_preemptions: int = 0
    num_aborted: int = 0


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, block_manager: BlockManager, policy: SchedulingPolicy) -> None:
        self.cfg = cfg
        self.block_manager = block_manager
        self.policy = policy
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.counters = SchedulerCounters()
        self._pending_aborts: list[Request] = []

    def add_request(self, request: Request) -> None:
        """Queue a request, or abort it at once with a reason when it can never run."""
        reason = self._rejection(request)
        if reason is not None:
            self.abort(request, reason)
            return
        self.waiting.extend(request.seqs)

    def _rejection(self, request: Request) -> str | None:
        if request.abort_reason is not None:
            return request.abort_reason
        if request.num_prompt_tokens == 0:
            return "empty prompt"
        if request.num_prompt_tokens > self.cfg.max_model_len:
            return (
                f"prompt has {request.num_prompt_tokens} tokens, more than "
                f"max_model_len={self.cfg.max_model_len}"
            )
        return None

    def abort(self, request: Request, reason: str) -> None:
        request.abort_reason = reason
        for seq in request.seqs:
            if self.block_manager.has_blocks(seq):
                self.block_manager.free(seq)
            if seq in self.waiting:
                self.waiting.remove(seq)
            if seq in self.running:
                self.running.remove(seq)
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = FinishReason.ABORTED
        self.counters.num_aborted += 1
        self._pending_aborts.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._pending_aborts)

    def schedule(self, now: float) -> SchedulerOutput:
        out = self._schedule_prefills(now)
        if out.is_empty:
            out = self._schedule_decodes(now)
        out.aborted, self._pending_aborts = self._pending_aborts, []
        return out

    def _schedule_prefills(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput(is_prefill=True)
        if not self.waiting:
            return out
        token_budget = self.cfg.max_num_batched_tokens
        admitted: list[Sequence] = []
        for seq in self.policy.order(self.waiting, now):
            if len(self.running) + len(admitted) >= self.cfg.max_num_seqs:
                break
            if seq.num_tokens > token_budget:
                break
            status = self.block_manager.can_allocate(seq)
            if status is AllocStatus.NEVER:
                bm = self.block_manager
                self.abort(
                    seq.request,
                    f"needs {-(-seq.num_tokens // bm.block_size)} blocks for {seq.num_tokens} tokens but "
                    f"the cache has {bm.num_total_blocks} blocks (watermark {bm.watermark_blocks})",
                )
                continue
            if status is AllocStatus.LATER:
                break
            seq.num_computed_tokens = self.block_manager.allocate(seq)
            seq.status = SeqStatus.RUNNING
            token_budget -= seq.num_tokens
            admitted.append(seq)
            out.scheduled.append(
                ScheduledSeq(
                    seq,
                    seq.num_tokens - seq.num_computed_tokens,
                    self.block_manager.block_table(seq),
                    num_samples=self._num_samples(seq),
                )
            )
        for seq in admitted:
            self.waiting.remove(seq)
        self.running.extend(admitted)
        return out

    @staticmethod
    def _num_samples(seq: Sequence) -> int:
        request = seq.request
        first_sample = seq.num_output_tokens == 0 and len(request.seqs) == 1
        return request.params.n if first_sample else 1

    def _schedule_decodes(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput(is_prefill=False)
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            while not self.block_manager.can_append_slots(seq):
                victim = self.policy.choose_victim([*queue, seq], now)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
                queue.remove(victim)
            else:
                out.blocks_to_copy.extend(self.block_manager.append_slots(seq))
                out.scheduled.append(ScheduledSeq(seq, 1, self.block_manager.block_table(seq)))
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.request.num_preemptions += 1
        self.counters.num_preemptions += 1
        self.waiting.append(seq)

    def add_forked(self, child: Sequence) -> None:
        self.running.append(child)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        self.running.remove(seq)
