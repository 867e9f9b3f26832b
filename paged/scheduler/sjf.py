"""Shortest job first on predicted job length, with aging so long jobs cannot starve; the longest
predicted remaining job is preempted.

Why: serving the job that will finish first minimises mean latency (the SRPT argument that
length-aware LLM schedulers build on: FastServe, S3, Fu et al. 2024 "Efficient LLM Scheduling by
Learning to Rank"). An LLM job's length is mostly its output, unknown until it ends, so the output
part is a prediction from `paged.scheduler.length_predictor`, chosen by `predictor`: `oracle` (the
true length; needs workload.ignore_eos), `bucket-mean` (learns from finished requests, `prior`
before any finished) or `none` (prompt only). Comparing `scheduler=sjf` with `scheduler=sjf-oracle`
shows what the predictor costs.

A job's remaining length is the tokens it still has to run through the model before its next
sample (its prompt; a recompute-preempted sequence's outputs too; 1 for a decode) plus its
predicted output tokens not generated yet. A sequence that has outrun its prediction counts no
output left. A waiting sequence's length shrinks by `aging_tokens_per_s` for every second since it
arrived, so any request eventually ranks ahead of newly arriving short ones.
"""

from __future__ import annotations

from paged.request import Request, Sequence
from paged.scheduler.length_predictor import make_predictor
from paged.scheduler.policy import SchedulingPolicy


class SJFPolicy(SchedulingPolicy):
    step_invariant = True
    def __init__(self, predictor: str = "bucket-mean", aging_tokens_per_s: float = 256.0, prior: float = 128.0) -> None:
        if not aging_tokens_per_s >= 0:
            raise ValueError(f"aging_tokens_per_s must be >= 0, got {aging_tokens_per_s!r}")
        if not prior >= 0:
            raise ValueError(f"prior must be >= 0 (output tokens assumed before any request finished), got {prior!r}")
        self.aging_tokens_per_s = aging_tokens_per_s
        self.predictor = make_predictor(predictor, prior)

    def remaining(self, seq: Sequence) -> float:
        """Predicted tokens `seq` still runs through the model."""
        pending = seq.num_tokens - seq.num_computed_tokens
        return pending + max(self.predictor.predict(seq.request) - seq.num_output_tokens, 0.0)

    def admission_key(self, seq: Sequence, now: float) -> tuple[float, float, int]:
        waited = max(0.0, now - seq.request.arrival_time)
        effective = self.remaining(seq) - self.aging_tokens_per_s * waited
        return (effective, seq.request.arrival_time, seq.seq_id)

    def victim_key(self, seq: Sequence, now: float) -> tuple[float, float, int]:
        return (self.remaining(seq), seq.request.arrival_time, seq.seq_id)

    def on_finished(self, request: Request, now: float) -> None:
        self.predictor.observe(request)
