"""What an executor returns for one step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ExecutorOutput:
    """Sampled token ids per scheduled sequence, in `SchedulerOutput.scheduled` order (empty for a
    sequence whose prompt is only partly computed), and where the step's time went."""

    sampled: list[list[int]]
    num_computed_tokens: int = 0
    model_time_s: float = 0.0  # forward pass, attention and sampling
    prep_time_s: float = 0.0  # building the step's input tensors: engine overhead, not model time
    attention_version: str | None = None  # the decode kernel that ran (v1/v2); None without decode rows
