"""The request-level view of sequences: how many tokens each samples and how samples branch them.

A request owns a group of sequences (samples or beams). The scheduler asks its group how many
tokens a scheduled sequence samples, and hands it each step's samples of all its sequences; the
group answers with a `GroupUpdate` that the scheduler applies: fork a child off a parent's blocks,
append a token, prune a beam, finish the group. Parallel sampling forks its extra samples off the
prompt this way; beam search forks, appends and prunes every step. When the group finishes it
chooses the request's completions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import NamedTuple

from paged.request import Completion, FinishReason, Request, Sequence
from paged.step import Samples, TokenLogprobs


class Token(NamedTuple):
    token_id: int
    logprob: float = 0.0
    top_logprobs: TokenLogprobs | None = None


@dataclass
class GroupUpdate:
    forks: list[tuple[Sequence, Token]] = field(default_factory=list)  # (parent, the child's first token)
    appends: list[tuple[Sequence, Token]] = field(default_factory=list)  # (sequence, its next token)
    prunes: list[Sequence] = field(default_factory=list)  # live sequences to drop (beams without a child)
    done: bool = False  # the group is finished: every live sequence ends with it


def tokens_of(samples: Samples) -> list[Token]:
    tops = samples.top_logprobs or [None] * len(samples.token_ids)
    return [Token(t, lp, top) for t, lp, top in zip(samples.token_ids, samples.logprobs, tops, strict=True)]


class SequenceGroup(ABC):
    # Whether the scheduler ends each sequence on EOS, stop strings and length (a beam search ends
    # its beams itself).
    checks_stops: bool = True

    def __init__(self, request: Request) -> None:
        self.request = request

    @abstractmethod
    def num_samples(self, seq: Sequence) -> int:
        """Tokens to sample from `seq`'s last position when its step completes it."""

    @abstractmethod
    def process(self, samples: list[tuple[Sequence, Samples]]) -> GroupUpdate:
        """One step's samples of this group's sequences -> the forks, appends and prunes to apply."""

    @abstractmethod
    def completions(self) -> list[Completion]:
        """The request's outputs, best first where they are ranked; asked once the group is finished."""

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.request.seqs)


class ParallelSampling(SequenceGroup):
    """`best_of` independent samples (1: plain generation). The first step samples all of them from
    the prompt; the first continues the sequence, each other one forks a child sharing its blocks.
    The request returns `n` of them: all, or with best_of > n the n of highest cumulative
    log-probability."""

    def num_samples(self, seq: Sequence) -> int:
        best_of = self.request.params.best_of
        if best_of == 1:
            return 1
        first_step = len(self.request.seqs) == 1 and seq.num_output_tokens == 0
        return best_of if first_step else 1

    @property
    def is_finished(self) -> bool:
        # before its first samples fork it, a best_of > 1 request has only one sequence
        return len(self.request.seqs) == self.request.params.best_of and super().is_finished

    def process(self, samples: list[tuple[Sequence, Samples]]) -> GroupUpdate:
        update = GroupUpdate()
        for seq, drawn in samples:
            tokens = tokens_of(drawn)
            update.forks.extend((seq, token) for token in tokens[1:])
            update.appends.append((seq, tokens[0]))
        return update

    def completions(self) -> list[Completion]:
        seqs = sorted(self.request.seqs, key=lambda s: s.index)
        params = self.request.params
        if params.best_of is not None and params.best_of > params.n:
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[: params.n]
        return [s.completion() for s in seqs]


@dataclass(slots=True)
class _Candidate:
    score: float  # cumulative log-probability with this token
    parent: Sequence
    token: Token
    rank: int  # position among the step's candidates, best first


class BeamSearch(SequenceGroup):
    """HF transformers' beam search (`generate(num_beams=k, do_sample=False)`), step for step, so the
    outputs match it token for token.

    Each step every live beam proposes its `num_samples` most likely tokens; of all proposals the
    top `num_samples` are candidates. A candidate that ends (EOS or a stop token, or the length limit)
    becomes a hypothesis if it ranks among the first `k` and the search can still improve, scored
    by cumulative log-probability / generated length ** length_penalty; the top `k` others are the
    next beams. A beam with several surviving children forks (its blocks are shared, copied on
    write), a beam with none is pruned. The search ends when `k` hypotheses exist and
    `early_stopping=True`, when (early_stopping False / "never") no running beam can beat the worst
    hypothesis by HF's estimate, or when every candidate ended. The request returns the best `n`
    hypotheses."""

    checks_stops = False

    def __init__(self, request: Request, eos_token_ids: Collection[int], max_model_len: int) -> None:
        super().__init__(request)
        p = request.params
        self.width = p.beam_width
        self.ends = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(eos_token_ids))
        # HF keeps (1 + EOS tokens) x width candidates, at least 2 x width: enough live ones survive
        self.num_candidates = max(2, 1 + len(self.ends)) * self.width
        self.max_len = min(request.num_prompt_tokens + p.max_tokens, max_model_len)
        self.hypotheses: list[tuple[float, Completion]] = []  # (normalised score, completion), best first
        self.can_improve = True

    def num_samples(self, seq: Sequence) -> int:
        return self.num_candidates

    def _score(self, cumulative: float, generated: int) -> float:
        return cumulative / generated**self.request.params.length_penalty

    def process(self, samples: list[tuple[Sequence, Samples]]) -> GroupUpdate:
        live = [s for s in self.request.seqs if not s.is_finished]
        if len(samples) != len(live):
            raise RuntimeError(f"beam search step got samples of {len(samples)} of its {len(live)} live beams")
        cur_len = samples[0][0].num_tokens
        proposals = [
            (beam.cumulative_logprob + token.logprob, b, j, beam, token)
            for b, (beam, drawn) in enumerate(samples)
            for j, token in enumerate(tokens_of(drawn))
        ]
        proposals.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = [_Candidate(c[0], c[3], c[4], r) for r, c in enumerate(proposals[: self.num_candidates])]
        at_limit = cur_len + 1 >= self.max_len
        ended = [at_limit or c.token.token_id in self.ends for c in candidates]
        self._add_hypotheses([c for c, e in zip(candidates, ended) if e and c.rank < self.width], cur_len + 1)
        running = [c for c, e in zip(candidates, ended) if not e][: self.width]
        if running and self.can_improve and len(self.hypotheses) == self.width:
            p = self.request.params
            horizon = self.max_len if p.early_stopping == "never" and p.length_penalty > 0 else cur_len + 1
            best_possible = self._score(running[0].score, horizon - self.request.num_prompt_tokens)
            self.can_improve = best_possible > self.hypotheses[-1][0]
        full = len(self.hypotheses) == self.width and self.request.params.early_stopping is True
        if not running or not self.can_improve or full:
            return GroupUpdate(done=True)
        return self._branch(live, running)

    def _add_hypotheses(self, ended: list[_Candidate], length: int) -> None:
        """HF adds finished candidates only while the search can improve and, with early_stopping,
        until it holds `width` hypotheses; it keeps the best `width`."""
        if not ended or not self.can_improve:
            return
        if len(self.hypotheses) == self.width and self.request.params.early_stopping is True:
            return
        generated = length - self.request.num_prompt_tokens
        for c in ended:
            parent, token = c.parent, c.token
            logprobs = None if parent.logprobs is None else [*parent.logprobs, token.top_logprobs or {}]
            finish = FinishReason.STOP if token.token_id in self.ends else FinishReason.LENGTH
            completion = Completion(
                0, [*parent.output_token_ids, token.token_id], c.score, finish, logprobs,
                token.token_id if finish is FinishReason.STOP else None,
            )
            self.hypotheses.append((self._score(c.score, generated), completion))
        self.hypotheses.sort(key=lambda h: -h[0])
        del self.hypotheses[self.width :]

    @staticmethod
    def _branch(live: list[Sequence], running: list[_Candidate]) -> GroupUpdate:
        """The next beams as forks and appends of this step's beams; beams left without a child go."""
        update = GroupUpdate()
        children: dict[Sequence, list[Token]] = {}
        for c in running:
            children.setdefault(c.parent, []).append(c.token)
        for beam in live:
            tokens = children.get(beam)
            if not tokens:
                update.prunes.append(beam)
                continue
            update.forks.extend((beam, t) for t in tokens[1:])
            update.appends.append((beam, tokens[0]))
        return update

    def completions(self) -> list[Completion]:
        chosen = self.hypotheses[: self.request.params.n]
        return [Completion(i, c.token_ids, c.cumulative_logprob, c.finish_reason, c.logprobs, c.stop_reason)
                for i, (_, c) in enumerate(chosen)]


def make_group(request: Request, eos_token_ids: Collection[int], max_model_len: int) -> SequenceGroup:
    if request.params.use_beam_search:
        return BeamSearch(request, eos_token_ids, max_model_len)
    return ParallelSampling(request)
