"""The engine loop: schedule, execute, update, record.

Sequence state changes only in the scheduler (`update_from_output`); the executor only computes
and samples; the engine wires them together on the executor's clock and records each step. It also
answers what its callers ask of the KV cache and the scheduler (stats, prefix-cache reset, counters),
so that no caller reaches into the scheduler's block manager or allocator. With async scheduling
(`scheduler.async_scheduling`) its steps are `AsyncStep`'s: the next step is launched before the
previous one's tokens are applied.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from paged.engine.async_step import AsyncStep
from paged.engine.held_steps import Hold
from paged.engine.metrics import MetricsRecorder
from paged.executor.base import Executor
from paged.request import Request
from paged.scheduler.core import Scheduler, SchedulerCounters
from paged.step import ExecutorOutput, KVStats


class StepShortcut(Protocol):
    """What hands out steps without running them one by one (`paged.engine.fast_forward`'s
    `FastForward`: a window of decode steps in which nothing can change, computed at once)."""

    def step(self, engine: Engine, until: float | None = None) -> bool:
        """Hand out the engine's next step, and with a horizon `until` (the next event the caller
        knows of) the steps after it that start before it; False when the engine must run it itself."""

    def cut(self) -> None:
        """Something other than a step happened (an arrival, an abort): end the window here."""


class Engine:
    def __init__(
        self, executor: Executor, scheduler: Scheduler, metrics: MetricsRecorder | None = None,
        async_scheduling: bool = False,
    ) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.metrics = metrics or MetricsRecorder()
        self.clock = executor.clock
        self.async_step = AsyncStep(scheduler, executor, self.metrics) if async_scheduling else None
        # executor=sim's exact fast-forward over decode steps in which nothing can change (None: off)
        self.fast_forward: StepShortcut | None = None
        # a fleet's replica: where its steps' statistics wait for their turn (`HeldSteps`; None: counted now)
        self.hold: Hold | None = None

    def add_request(self, request: Request) -> None:
        if request.params.max_tokens is None:
            self._resolve_max_tokens(request)
        if self.fast_forward is not None:
            self.fast_forward.cut()
        self.metrics.on_add(request)
        self.scheduler.add_request(request)

    def _resolve_max_tokens(self, request: Request) -> None:
        """vLLM's `max_tokens=None`: as many tokens as `max_model_len` leaves after the prompt. The
        request gets its own params (the caller's may be shared by other prompts). A prompt that
        leaves no room (for `min_tokens`) is aborted by the scheduler's intake, with this reason."""
        params = request.params
        max_model_len = self.scheduler.max_model_len
        room = max_model_len - request.num_prompt_tokens
        need = max(params.min_tokens, 1)
        if room < need and request.abort_reason is None:
            request.abort_reason = (
                f"max_tokens=None: the prompt's {request.num_prompt_tokens} tokens leave {max(room, 0)} of "
                f"max_model_len={max_model_len} to generate, fewer than {need}"
            )
        request.params = dataclasses.replace(params, max_tokens=max(room, need))

    def abort(self, request: Request, reason: str) -> None:
        """Abort `request` wherever it is (waiting, running, swapped), freeing its blocks; the next
        `step` returns it among the finished, with `reason` as its abort reason. A step in flight is
        applied first, so that the request keeps every token computed for it; one that ends in it is
        not aborted."""
        if self.fast_forward is not None:
            self.fast_forward.cut()
        if self.async_step is not None and request in self.async_step.settle():
            return
        self.scheduler.abort(request, reason)

    def abort_all(self, reason: str) -> list[Request]:
        """Abort every request the engine holds (waiting, running, swapped) with `reason` and step
        until it holds none, so that it is as if they never came; returns them. Nothing is computed:
        the steps only return the aborted. The prefix cache keeps only blocks whose step completed
        (a block is published after `execute` returns), so a step that raised leaves none behind."""
        if self.fast_forward is not None:
            self.fast_forward.cut()
        if self.async_step is not None:
            self.async_step.settle()
        s = self.scheduler
        held = list(dict.fromkeys(seq.request for seq in (*s.waiting, *s.running, *s.swapped)))
        for request in held:
            self.abort(request, reason)
        while self.has_unfinished:
            self.step()
        return held

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or (self.async_step is not None and self.async_step.busy)

    def step(self, until: float | None = None, releases: bool = False) -> list[Request]:
        """Run one iteration; returns the requests that finished (or were aborted) in it. Under
        fast-forward, run the next step of a window (`paged.engine.fast_forward`), and with a
        horizon `until` (the time of the next arrival its caller knows of: nothing reaches the
        engine before it) every later step of the window that starts before it: none finish.
        `releases` (a finishing step may release follow-ups) changes nothing here: a window holds
        no finishing step."""
        if self.async_step is not None:
            return self.async_step.step()
        if self.fast_forward is not None and self.fast_forward.step(self, until):
            return []
        start = self.clock.now()
        sched = self.scheduler.schedule(start)
        self.metrics.on_scheduled(sched, self.scheduler.waiting)
        # a step whose only sequence was swapped out still moves its blocks (and the tiers' evictions)
        busy = sched.scheduled or sched.blocks_to_swap_out or sched.blocks_to_swap_in or sched.blocks_to_offload
        output = self.executor.execute(sched) if busy else ExecutorOutput([])
        finished = self.scheduler.update_from_output(sched, output, self.clock.now())
        if sched.scheduled:
            self.metrics.on_step(sched, output, self.scheduler.stats(), start, self.clock.now(), self.hold)
        return finished

    # -- what callers ask ------------------------------------------------------------------------

    def kv_stats(self) -> KVStats:
        """The KV cache now: pool size, blocks in use, and the prefix-cache counters (cumulative
        since the engine was built)."""
        return self.scheduler.kv_stats()

    def request_counts(self) -> tuple[int, int]:
        """Requests running and waiting now (`Scheduler.request_counts`): what a progress bar shows."""
        return self.scheduler.request_counts()

    def kv_usage(self) -> float:
        """The fraction of the KV pool's blocks in use (a router's load signal)."""
        return self.scheduler.kv_usage()

    @property
    def block_size(self) -> int:
        return self.scheduler.block_size

    @property
    def caches_prefixes(self) -> bool:
        """Whether the allocator keeps a prefix cache (without one, a hit rate means nothing)."""
        return self.scheduler.caches_prefixes

    def cached_prefix_blocks(self, chain: list[bytes]) -> int:
        """Blocks from the start of `chain` (a prompt's `prompt_block_hashes`) the prefix cache holds now."""
        return self.scheduler.cached_prefix_blocks(chain)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefix blocks; False (and nothing dropped) while requests hold blocks."""
        return self.scheduler.reset_prefix_cache()

    @property
    def counters(self) -> SchedulerCounters:
        """Preemptions, aborts and swaps so far."""
        return self.scheduler.counters

    def kv_press_summary(self) -> dict[str, Any]:
        """summary.json's kv_press_* keys (`paged.scheduler.press_step`); none without a press."""
        press_step = self.scheduler.press_step
        return press_step.summary() if press_step is not None else {}

    @property
    def num_swap_fallbacks(self) -> int:
        """Swap preemptions that recomputed instead (the CPU pool was full)."""
        return self.scheduler.preemption.num_recompute_fallbacks

    def plugin_classes(self) -> dict[str, str]:
        """The qualified class of each part a config can replace: allocator, policy, preemption, executor."""
        parts = {**self.scheduler.plugin_parts(), "executor": self.executor}
        return {role: f"{type(obj).__module__}.{type(obj).__qualname__}" for role, obj in parts.items()}
