"""What an executor returns for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged.model.sampler import Samples, TokenLogprobs


@dataclass
class ExecutorOutput:
    """Sampled token ids per scheduled sequence, in `SchedulerOutput.scheduled` order (empty for a
    sequence whose prompt is only partly computed), and where the step's time went."""

    sampled: list[list[int]]
    num_computed_tokens: int = 0
    model_time_s: float = 0.0  # forward pass, attention and sampling
    prep_time_s: float = 0.0  # building the step's input tensors: engine overhead, not model time
    attention_version: str | None = None  # the decode kernel that ran (v1/v2); None without decode rows
    # per scheduled sequence, each sampled token's log-probability (None: an executor without them, 0.0)
    logprobs: list[list[float]] | None = None
    # per scheduled sequence, per sampled token its own and the top-k log-probabilities, when asked
    top_logprobs: list[list[TokenLogprobs] | None] | None = None
    # seq_id -> per prompt token (None for the first) for requests asking for prompt_logprobs
    prompt_logprobs: dict[int, list[TokenLogprobs | None]] = field(default_factory=dict)

    def samples(self, i: int) -> Samples:
        """What the i-th scheduled sequence sampled."""
        tokens = self.sampled[i]
        logprobs = self.logprobs[i] if self.logprobs is not None else [0.0] * len(tokens)
        return Samples(tokens, logprobs, self.top_logprobs[i] if self.top_logprobs is not None else None)
