"""The engine loop: schedule, execute, then apply sampled tokens, finish and free sequences."""

from __future__ import annotations

import time
from collections.abc import Callable

from paged.executor.base import Executor, ExecutorOutput
from paged.memory import BlockManager
from paged.metrics import MetricsRecorder, StepRecord
from paged.request import FinishReason, Request, Sequence
from paged.scheduler.core import Scheduler
from paged.scheduler.output import SchedulerOutput


class Engine:
    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler,
        metrics: MetricsRecorder | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.block_manager: BlockManager = scheduler.block_manager
        self.metrics = metrics or MetricsRecorder()
        self._clock = clock
        self._t0 = clock()
        self.step_index = 0
        eos = executor.eos_token_id
        self._eos_ids = frozenset(eos if isinstance(eos, list | tuple) else [eos] if eos is not None else [])

    def now(self) -> float:
        """Seconds since the engine's time origin; request arrival times use the same origin."""
        return self._clock() - self._t0

    def reset_clock(self) -> None:
        self._t0 = self._clock()

    def add_request(self, request: Request) -> None:
        self.metrics.on_add(request)
        self.scheduler.add_request(request)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[Request]:
        """Run one iteration; returns the requests that finished (or were aborted) in it."""
        t_start = self._clock()
        now = t_start - self._t0
        sched = self.scheduler.schedule(now)
        for request in sched.aborted:
            request.finish_time = now
        finished = list(sched.aborted)
        result: ExecutorOutput | None = None
        if not sched.is_empty:
            result = self.executor.execute(sched)
        t_exec = self._clock()
        if result is not None:
            finished.extend(self._postprocess(sched, result, t_exec - self._t0))
        t_end = self._clock()
        for request in finished:
            self.metrics.on_finish(request)
        if not sched.is_empty:
            self._record(sched, result, t_start, t_exec, t_end)
        return finished

    def _postprocess(self, sched: SchedulerOutput, result: ExecutorOutput, now: float) -> list[Request]:
        finished: list[Request] = []
        for item, tokens in zip(sched.scheduled, result.sampled):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.mark_computed(seq)
            if not tokens:
                continue
            request = seq.request
            if request.first_token_time is None:
                request.first_token_time = now
            for index, token in enumerate(tokens[1:], start=1):
                child = seq.fork(index)
                self.block_manager.fork(seq, child)
                request.seqs.append(child)
                self.scheduler.add_forked(child)
                self._append(child, token)
            self._append(seq, tokens[0])
            if request.is_finished and request.finish_time is None:
                request.finish_time = now
                finished.append(request)
        return finished

    def _append(self, seq: Sequence, token: int) -> None:
        seq.token_ids.append(token)
        params = seq.request.params
        reason: FinishReason | None = None
        if (token in self._eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.scheduler.cfg.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish(seq, reason)

    def _record(
        self,
        sched: SchedulerOutput,
        result: ExecutorOutput | None,
        t_start: float,
        t_exec: float,
        t_end: float,
    ) -> None:
        stats = self.block_manager.stats()
        bm = self.block_manager
        prep = getattr(self.executor, "last_prep_time_s", 0.0)
        step_time = t_end - t_start
        exec_time = result.step_time_s if result is not None else 0.0
        self.step_index += 1
        self.metrics.on_step(
            StepRecord(
                engine_step=self.step_index,
                time_s=t_end - self._t0,
                is_prefill=sched.is_prefill,
                batch_size=len(sched.scheduled),
                num_scheduled_tokens=sched.num_batched_tokens,
                num_computed_tokens=result.num_computed_tokens if result is not None else 0,
                step_time_s=step_time,
                overhead_s=max(0.0, step_time - exec_time) + prep,
                num_running=len(self.scheduler.running),
                num_waiting=len(self.scheduler.waiting),
                num_preempted=len(sched.preempted),
                kv_usage=stats.kv_usage,
                token_state_fraction=stats.token_state_fraction,
                num_allocated_blocks=stats.num_allocated_blocks,
                num_cached_free_blocks=stats.num_cached_free_blocks,
                prefix_queried_tokens=bm.num_queried_tokens,
                prefix_hit_tokens=bm.num_hit_tokens,
            )
        )

    def run_until_done(self, on_step: Callable[[list[Request]], None] | None = None) -> None:
        while self.has_unfinished:
            finished = self.step()
            if on_step is not None:
                on_step(finished)
