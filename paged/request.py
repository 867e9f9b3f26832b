"""Requests, sequences and sampling parameters: the records every layer passes around."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to sample one request; mirrors vLLM's names so scripts switch by one import."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    n: int = 1
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables top-k), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV in the CPU pool
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORTED = "aborted"


_seq_ids = itertools.count()


class Sequence:
    """One generated continuation: the scheduling unit. A request with n > 1 owns n of them."""

    def __init__(self, request: Request, token_ids: list[int], index: int = 0) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_prompt_tokens = request.num_prompt_tokens
        self.num_computed_tokens = 0
        self.status = SeqStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def fork(self, index: int) -> Sequence:
        child = Sequence(self.request, list(self.token_ids), index)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request.request_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )


class Request:
    """A prompt and its sampling parameters, plus the timestamps that metrics are built from."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float = 0.0,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.seqs: list[Sequence] = [Sequence(self, list(prompt_token_ids))]
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.abort_reason: str | None = None
        self.num_preemptions = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> FinishReason | None:
        if self.abort_reason is not None:
            return FinishReason.ABORTED
        return self.seqs[0].finish_reason

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, prompt_len={self.num_prompt_tokens}, n={self.params.n})"
