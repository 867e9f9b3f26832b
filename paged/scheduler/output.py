"""What the scheduler hands the executor for one engine step."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged.request import Request, Sequence


@dataclass(slots=True)
class ScheduledSeq:
    """Compute `seq.token_ids[num_computed : num_computed + num_new_tokens]` this step.

    `num_computed` is `seq.num_computed_tokens` before the step: the KV of those tokens is
    already in the cache (earlier steps or prefix-cache hits). `num_samples` tokens are sampled
    from the last position, as the request's sequence group decides: 0 while a prompt is only
    partly computed, `n` when a request with n > 1 samples its first tokens (the group then forks
    the other n - 1 sequences), else 1.
    """

    seq: Sequence
    num_new_tokens: int
    block_table: list[int]
    num_samples: int = 1

    @property
    def num_computed(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def context_len(self) -> int:
        return self.seq.num_computed_tokens + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """One generated token extends the sequence; any other row computes (part of) a prompt, or
        recomputes a preempted sequence. Only meaningful before the step is applied."""
        seq = self.seq
        return self.num_new_tokens == 1 and seq.num_output_tokens > 0 and seq.num_computed_tokens + 1 == seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # whether any row computes a prompt (chunked prefill mixes them with decode rows in one step)
    is_prefill: bool = False
    num_decode_rows: int = 0
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # (device block, CPU block) pairs to move out before the step, (CPU block, device block) in;
    # a step never does both (swap-ins are only scheduled when nothing was preempted)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    aborted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
