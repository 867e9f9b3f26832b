"""The request-level view of sequences: how many tokens each samples and how samples branch them.

A request owns a group of sequences. The scheduler asks its group how many tokens a scheduled
sequence samples, and hands it each step's samples; the group answers with a `GroupUpdate` that the
scheduler applies (fork a child off a parent's blocks, append a token). Parallel sampling forks its
n - 1 extra samples off the prompt this way; beam search is another group on the same path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from paged.request import Request, Sequence


@dataclass
class GroupUpdate:
    forks: list[tuple[Sequence, int]] = field(default_factory=list)  # (parent, the child's first token)
    appends: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, its next token)


class SequenceGroup(ABC):
    def __init__(self, request: Request) -> None:
        self.request = request

    @abstractmethod
    def num_samples(self, seq: Sequence) -> int:
        """Tokens to sample from `seq`'s last position when its step completes it."""

    @abstractmethod
    def process(self, samples: list[tuple[Sequence, list[int]]]) -> GroupUpdate:
        """One step's samples of this group's sequences -> the forks and appends to apply."""

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.request.seqs)


class ParallelSampling(SequenceGroup):
    """`n` independent samples (n = 1: plain generation). The first step samples n tokens from the
    prompt; the first continues the sequence, each other one forks a child sharing its blocks."""

    def num_samples(self, seq: Sequence) -> int:
        n = self.request.params.n
        if n == 1:
            return 1
        first_step = len(self.request.seqs) == 1 and seq.num_output_tokens == 0
        return n if first_step else 1

    @property
    def is_finished(self) -> bool:
        # before its first sample forks it, an n > 1 request has only one sequence
        return len(self.request.seqs) == self.request.params.n and super().is_finished

    def process(self, samples: list[tuple[Sequence, list[int]]]) -> GroupUpdate:
        update = GroupUpdate()
        for seq, tokens in samples:
            if len(tokens) > 1:
                update.forks.extend((seq, token) for token in tokens[1:])
            update.appends.append((seq, tokens[0]))
        return update
