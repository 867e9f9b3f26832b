"""Requests, sequences and sampling parameters: the records every layer passes around."""

from __future__ import annotations

import enum
import functools
import itertools
from array import array
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged.detokenizer import IncrementalDetokenizer

# vLLM's `max_logprobs` default: the most top log-probabilities a request may ask for per token.
MAX_LOGPROBS = 20
# Below this a temperature means greedy (vLLM's _SAMPLING_EPS).
_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """How to sample one request: vLLM's field names, defaults and checks, so a vLLM script runs
    unchanged. The default temperature is vLLM's 1.0 (random sampling); pass temperature=0 for
    greedy. `top_k` -1 and 0 both disable top-k (stored as 0). `stop` may be one string or a list.
    Beam search (`use_beam_search=True`, `n` = beam width) is vLLM V0's interface."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # None (vLLM's): as many as the context leaves, max_model_len less the prompt (Engine.add_request)
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == -1:
            self.top_k = 0
        self.stop_strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._verify()
        if self.use_beam_search:
            self._verify_beam_search()
        else:
            self._verify_non_beam_search()

    def _verify(self) -> None:
        _integer("n", self.n, 1)
        _integer("best_of", self.best_of, 1)
        if self.best_of < self.n:
            raise ValueError(f"best_of must be >= n, got n={self.n} and best_of={self.best_of}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, 1)
        _integer("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    def _verify_beam_search(self) -> None:
        if self.best_of == 1:
            raise ValueError(f"beam search needs a beam width (n, or best_of) > 1, got n={self.n}")
        if self.temperature >= _GREEDY_EPS:
            raise ValueError(f"temperature must be 0 with beam search, got {self.temperature!r}")
        if self.top_p < 1.0 or self.top_k or self.min_p:
            raise ValueError(
                f"beam search ranks by log-probability: top_p must be 1, top_k -1 or 0 and min_p 0, got "
                f"top_p={self.top_p!r}, top_k={self.top_k!r}, min_p={self.min_p!r}"
            )
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")

    def _verify_non_beam_search(self) -> None:
        if self.early_stopping is not False:
            raise ValueError(
                f"early_stopping only applies to beam search and must be False without it, got {self.early_stopping!r}"
            )
        if self.length_penalty != 1.0:
            raise ValueError(
                f"length_penalty only applies to beam search and must be 1.0 without it, got {self.length_penalty!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @functools.cached_property
    def argmax_only(self) -> bool:
        """Whether a token is the logits' argmax and nothing more: greedy, one sample, no penalty,
        no log-probabilities (`min_tokens`, which depends on the sequence, is checked per row). The
        usual row; the executor samples a batch of them with one argmax. Cached: the sampler asks once
        per row per step, and params are not changed once a request is submitted."""
        return (self.greedy and not self.use_beam_search and self.best_of == 1 and self.logprobs is None
                and self.repetition_penalty == 1.0 and not self.presence_penalty and not self.frequency_penalty)

    @property
    def beam_width(self) -> int:
        """Beams kept per step (beam search); sequences a request samples otherwise."""
        assert self.best_of is not None
        return self.best_of


def _integer(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted with its KV in the CPU pool
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORTED = "aborted"


@dataclass
class Completion:
    """One finished output of a request: a sample, or a beam-search hypothesis. `logprobs` holds,
    per output token, its own and the top-`SamplingParams.logprobs` log-probabilities (token ->
    (log-probability, rank)) when the request asked for them; `text` is set when the output was
    detokenized as it grew (stop strings), already cut at the stop string."""

    index: int
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: FinishReason | None
    logprobs: list[dict[int, tuple[float, int]]] | None = None
    stop_reason: str | int | None = None
    text: str | None = None


@dataclass(frozen=True)
class FollowUp:
    """What a follow-up request continues (a chat's next turn, an agent's next step): it is sent
    `think_time_s` after request `parent` finishes, and its prompt is then the parent's prompt and
    reply followed by its own tokens (`Request.follow`). It is closed-loop: the prompt cannot be built
    before the parent's reply exists. `paged.engine.runner.drive` holds such requests until then."""

    parent: str  # the request id of the request it follows
    think_time_s: float = 0.0


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
        self.cumulative_logprob = 0.0
        # per output token, when the request asks for logprobs: token -> (log-probability, rank)
        self.logprobs: list[dict[int, tuple[float, int]]] | None = [] if request.params.logprobs is not None else None
        self.stop_reason: str | int | None = None
        # set by the scheduler when the request has stop strings
        self.detokenizer: IncrementalDetokenizer | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        output = self.token_ids[self.num_prompt_tokens :]
        return output if isinstance(output, list) else output.tolist()  # a compacted sequence's

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def fork(self, index: int) -> Sequence:
        child = Sequence(self.request, list(self.token_ids), index)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.cumulative_logprob = self.cumulative_logprob
        if self.logprobs is not None:
            child.logprobs = list(self.logprobs)
        if self.detokenizer is not None:
            child.detokenizer = self.detokenizer.fork()
        return child

    def completion(self, index: int | None = None) -> Completion:
        return Completion(
            self.index if index is None else index, self.output_token_ids, self.cumulative_logprob,
            self.finish_reason, self.logprobs, self.stop_reason,
            None if self.detokenizer is None else self.detokenizer.text,
        )

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request.request_id}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )


def _held_output(tokens: list[int] | array | memoryview, seq_tokens: tuple[list[int] | array, array] | None,
                 num_prompt: int) -> array | memoryview:
    """A finished completion's tokens held compactly: a view of its sequence's output when equal to it
    (plain sampling), else an array of its own (a beam hypothesis, a pruned sequence); as it is when held
    so already. `seq_tokens`: the sequence's tokens as they were (a list compared as is) and as held now."""
    if not isinstance(tokens, list):
        return tokens
    if seq_tokens is not None:
        was, held = seq_tokens
        if len(was) == num_prompt + len(tokens):
            if isinstance(was, list):
                if was[num_prompt:] == tokens:
                    return memoryview(held)[num_prompt:]
            elif was[num_prompt:] == (own := array("i", tokens)):
                return memoryview(held)[num_prompt:]
            else:
                return own
    return array("i", tokens)


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
        client_id: str | None = None,
        follows: FollowUp | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # who sent it, for per-client fair sharing (None: the workload names no clients)
        self.client_id = client_id
        # a follow-up: its prompt_token_ids are only its own new tokens until `follow` prepends the parent's
        self.follows = follows
        self.seqs: list[Sequence] = [Sequence(self, list(self.prompt_token_ids))]  # the list's ints, shared
        # the prompt as 4-byte ints when given or held so (`expand`): the next `compact` copies it (None: none)
        packed = type(prompt_token_ids) is array and prompt_token_ids.typecode == "i"
        self.packed_prompt: array | None = prompt_token_ids if packed else None  # type: ignore[assignment]
        # (block size, the prompt's chained block hashes): `paged.memory.hashing.request_block_hashes`
        self.prompt_hashes: tuple[int, list[bytes]] | None = None
        self.first_token_time: float | None = None
        # engine time of each step that gave the request tokens (any of its sequences): the chunks a
        # streaming client sees, whose gaps are vLLM's inter-token latencies; 8 bytes a step, no objects
        self.token_times: array[float] = array("d")
        self.finish_time: float | None = None
        self.abort_reason: str | None = None
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        # seconds its KV took from a prefill to a decode replica (a disaggregated fleet); None: not moved
        self.kv_transfer_s: float | None = None
        # set by the request's sequence group when it finishes (best_of ranking, beam hypotheses)
        self.completions: list[Completion] | None = None
        # per prompt token (None for the first), when the request asks for prompt_logprobs
        self.prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None

    def next_seq_index(self) -> int:
        """The index of a sequence forked now: one past the highest so far (pruned beams leave gaps)."""
        return max(s.index for s in self.seqs) + 1

    def outputs(self) -> list[Completion]:
        """The request's completions: its group's choice once finished, else its sequences as they are."""
        if self.completions is not None:
            # compacted (`compact`): each completion's tokens as a list again
            return [c if isinstance(c.token_ids, list) else replace(c, token_ids=c.token_ids.tolist())
                    for c in self.completions]
        return [s.completion() for s in sorted(self.seqs, key=lambda s: s.index)]

    def follow(self, parent: Request) -> None:
        """Continue `parent`, which finished: this request's prompt becomes the parent's prompt, the
        parent's reply (its first completion: the best one with n or beam search) and this request's
        own tokens, and it arrives `follows.think_time_s` after the parent finished."""
        if self.follows is None or parent.request_id != self.follows.parent or parent.finish_time is None:
            raise ValueError(f"{self!r} does not follow {parent!r}, or that request has not finished")
        # unpacked: the parent, finished, may hold its tokens compacted (`compact`)
        self.prompt_token_ids = [*parent.prompt_token_ids, *parent.outputs()[0].token_ids, *self.prompt_token_ids]
        self.seqs = [Sequence(self, list(self.prompt_token_ids))]
        self.prompt_hashes = self.packed_prompt = None
        self.arrival_time = parent.finish_time + self.follows.think_time_s

    def compact(self) -> None:
        """Hold the request's token ids as 4-byte ints (`array('i')`; a list holds an 8-byte pointer
        to a 28-byte int per token), each once: a fleet hour holds 100M tokens, in prompts not yet
        sent and in finished requests. Every sequence's tokens start with the prompt, so the prompt
        is a view of the first sequence's array (that array itself before the request ran), and a
        completion equal to a sequence's output is a view of its tail. What a finished request is
        read for still works: lengths, `outputs()` (lists), indexing and slicing, a follow-up's
        prompt (`follow`); one not yet submitted is `expand`ed first."""
        n = len(self.prompt_token_ids)
        outputs = {}
        packed, self.packed_prompt = self.packed_prompt, None
        for seq in self.seqs:
            was = seq.token_ids
            if not isinstance(was, array):
                # every sequence starts with the prompt: copied as held (`expand`), only the rest converted
                held = array("i", was) if packed is None else packed + array("i", was[n:])
                seq.token_ids = held  # type: ignore[assignment]
            outputs[seq.index] = (was, seq.token_ids)
        if not self.seqs:
            self.prompt_token_ids = array("i", self.prompt_token_ids)  # type: ignore[assignment]
        elif len(first := self.seqs[0].token_ids) == n:
            self.prompt_token_ids = first
        else:
            self.prompt_token_ids = memoryview(first)[:n]  # type: ignore[assignment]
        if self.completions is not None:
            self.completions = [replace(c, token_ids=_held_output(c.token_ids, outputs.get(c.index), n))
                                for c in self.completions]

    def expand(self) -> None:
        """Undo `compact` before the request is submitted: its sequences' token ids grow as lists."""
        packed = self.prompt_token_ids
        if isinstance(packed, list):
            return
        self.prompt_token_ids = prompt = packed.tolist()
        self.packed_prompt = packed if isinstance(packed, array) else None
        for seq in self.seqs:
            if not isinstance(seq.token_ids, list):
                # one not yet run is the prompt's array: the prompt's ints, shared
                seq.token_ids = list(prompt) if seq.token_ids is packed else seq.token_ids.tolist()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finish_reason(self) -> FinishReason | None:
        if self.abort_reason is not None:
            return FinishReason.ABORTED
        # the completions as held: `outputs()` would copy a compacted request's tokens into lists
        outputs = self.outputs() if self.completions is None else self.completions
        return outputs[0].finish_reason if outputs else None

    def __repr__(self) -> str:
        return f"Request({self.request_id!r}, prompt_len={self.num_prompt_tokens}, n={self.params.n})"
