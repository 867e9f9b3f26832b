"""FastServe's skip-join multi-level feedback queue (Wu et al. 2023, "Fast Distributed Inference
Serving for Large Language Models", arXiv:2305.05920).

Why: output lengths are unknown, so shortest-job-first cannot be applied directly; an MLFQ
approximates it by demoting whatever has run long. Level i grants a quantum of
`base_quantum * quantum_ratio**i` iterations (steps in which the request is scheduled, however many
of its sequences run); a request whose iterations at its level reach the quantum drops one level,
and the bottom level is plain FCFS. Lower levels are served first, FCFS within a level.

Skip-join: a new request does not always start at the top. Its prefill runs in its first iteration
whatever level it joins, so FastServe puts it straight into the highest level whose quantum covers
that first iteration: a long prompt cannot be short, so it skips the levels it would only be
demoted from. The quanta here count iterations, so the prefill is estimated as
`num_prompt_tokens / prefill_tokens_per_quantum` iterations: `prefill_tokens_per_quantum` is how many
prompt tokens cost about one decode iteration, a property of model and hardware to calibrate, not a
measured constant (FastServe profiles the first iteration's time instead).

FastServe preempts at iteration granularity, so the policy is preemptive: a waiting request in a
higher level (lower number) outranks running ones in lower levels; the victim is the newest request
of the lowest level. To keep demoted requests from starving, a request that has not been scheduled
for `starvation_s` seconds (since it was queued or last ran) is promoted to the top level, as
FastServe's starvation prevention does; the promotion is applied when the policy next looks at it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from paged.request import Request, Sequence
from paged.scheduler.policy import SchedulingPolicy

if TYPE_CHECKING:
    from paged.step import SchedulerOutput


@dataclass(slots=True)
class _Level:
    level: int
    iterations: int  # iterations served at this level
    last_served: float  # when it last ran, or was queued if it has not yet


class MLFQPolicy(SchedulingPolicy):
    step_invariant = False  # on_scheduled moves a request down the levels as its iterations add up
    preemptive = True

    def __init__(
        self,
        num_levels: int = 4,
        base_quantum: int = 8,
        quantum_ratio: float = 2.0,
        prefill_tokens_per_quantum: int = 64,
        starvation_s: float = 5.0,
    ) -> None:
        for name, value in (
            ("num_levels", num_levels), ("base_quantum", base_quantum),
            ("prefill_tokens_per_quantum", prefill_tokens_per_quantum),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not quantum_ratio >= 1:
            raise ValueError(f"quantum_ratio must be >= 1 (lower levels get longer quanta), got {quantum_ratio!r}")
        if not starvation_s > 0:
            raise ValueError(f"starvation_s must be > 0 seconds, got {starvation_s!r}")
        self.quanta = [base_quantum * quantum_ratio**i for i in range(num_levels)]
        self.prefill_tokens_per_quantum = prefill_tokens_per_quantum
        self.starvation_s = starvation_s
        self._levels: dict[Request, _Level] = {}

    def join_level(self, request: Request) -> int:
        """Skip-join: the highest level whose quantum covers the estimated prefill iterations."""
        prefill = request.num_prompt_tokens / self.prefill_tokens_per_quantum
        return next((i for i, q in enumerate(self.quanta) if q >= prefill), len(self.quanta) - 1)

    def level(self, request: Request, now: float) -> int:
        state = self._levels[request]
        if state.level and now - state.last_served >= self.starvation_s:
            state.level, state.iterations = 0, 0
        return state.level

    def admission_key(self, seq: Sequence, now: float) -> tuple[int, float, int]:
        return (self.level(seq.request, now), seq.request.arrival_time, seq.seq_id)

    def victim_key(self, seq: Sequence, now: float) -> tuple[int, float, int]:
        return self.admission_key(seq, now)

    def outranks(self, waiting: Sequence, running: Sequence, now: float) -> bool:
        return self.level(waiting.request, now) < self.level(running.request, now)

    def on_add(self, request: Request, now: float) -> None:
        # a request re-queued after preemption keeps the level it has earned
        if request not in self._levels:
            self._levels[request] = _Level(self.join_level(request), 0, now)

    def on_scheduled(self, out: SchedulerOutput, now: float) -> None:
        bottom = len(self.quanta) - 1
        for request in dict.fromkeys(row.seq.request for row in out.scheduled):
            state = self._levels[request]
            state.iterations += 1
            state.last_served = now
            if state.level < bottom and state.iterations >= self.quanta[state.level]:
                state.level, state.iterations = state.level + 1, 0

    def on_finished(self, request: Request, now: float) -> None:
        self._levels.pop(request, None)
