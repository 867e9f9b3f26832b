"""`LLM(...).generate(prompts, sampling_params)` and `LLM.beam_search`: vLLM's offline API and
output records on the same engine `run.py` uses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from paged.builder import build_engine
from paged.config import compose_config
from paged.engine import Engine
from paged.executor.base import Executor
from paged.outputs import completion_text
from paged.request import Request, SamplingParams
from paged.runner import drive, to_request
from paged.step import TokenLogprobs, scores_tokens
from paged.workload import WorkloadItem


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's log-probability, its rank in the distribution (1 = most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobDict = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[LogprobDict] | None
    finish_reason: str | None
    # the stop string or stop token id that ended it (None: EOS, length, or not finished)
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestStateMetrics:
    """vLLM's `RequestMetrics`: when the request arrived, was first scheduled, produced its first
    token and finished, on the engine's clock (seconds)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: RequestStateMetrics | None = None
    prompt_logprobs: list[LogprobDict | None] | None = None
    abort_reason: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `LLM.beam_search` parameters (always greedy: temperature must stay 0)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            n=self.beam_width, use_beam_search=True, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
            temperature=self.temperature, length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output, early_stopping=self.early_stopping,
        )


@dataclass
class BeamSearchSequence:
    """One hypothesis: `tokens` holds prompt and output, as in vLLM."""

    tokens: list[int]
    logprobs: list[LogprobDict]
    cum_logprob: float
    text: str | None
    finish_reason: str | None
    stop_reason: str | int | None = None


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


PromptType = str | Sequence[int] | dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str = "smollm2-135m",
        *,
        allocator: str = "prefix",
        scheduler: str = "fcfs",
        kernel: str = "auto",
        overrides: Sequence[str] = (),
        executor: Executor | None = None,
    ) -> None:
        self.config = compose_config(
            [f"model={model}", f"allocator={allocator}", f"scheduler={scheduler}", f"kernel={kernel}",
             "logger=none", "progress=false", *overrides]
        )
        self.engine: Engine = build_engine(self.config, executor=executor)
        self.executor = self.engine.executor
        self._counter = 0

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        client_id: Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.generate`: one `RequestOutput` per prompt, in prompt order. Prompts are
        strings, token id lists, or vLLM's dicts ({"prompt": ...} / {"prompt_token_ids": [...]}).
        Without `sampling_params`, vLLM's defaults (temperature 1.0, 16 tokens). `priority` (vLLM's:
        lower first, for scheduler=priority) and `client_id` (for scheduler=fair) are per prompt."""
        prompts = self._prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        clients = list(client_id) if client_id is not None else [None] * len(prompts)
        for name, values in (("priority", priorities), ("client_id", clients)):
            if len(values) != len(prompts):
                raise ValueError(f"got {len(values)} {name} values for {len(prompts)} prompts")
        for p in priorities:
            if isinstance(p, bool) or not isinstance(p, int):
                raise ValueError(f"priority must be an integer (lower is served first), got {p!r}")
        for c in clients:
            if c is not None and not isinstance(c, str):
                raise ValueError(f"client_id must be a string or None, got {c!r}")
        requests = [
            self._request(prompt, p, prio, client)
            for prompt, p, prio, client in zip(prompts, sampling_params, priorities, clients, strict=True)
        ]
        drive(self.engine, requests, progress=use_tqdm, label="Processed prompts")
        return [self._output(r) for r in requests]

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: per prompt, its `beam_width` best hypotheses, best first."""
        outputs = self.generate(prompts, params.sampling_params(), use_tqdm=use_tqdm)
        return [
            BeamSearchOutput([
                BeamSearchSequence(
                    out.prompt_token_ids + c.token_ids, c.logprobs or [], c.cumulative_logprob or 0.0, c.text,
                    c.finish_reason, c.stop_reason,
                )
                for c in out.outputs
            ])
            for out in outputs
        ]

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefix blocks; False (and nothing dropped) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    @staticmethod
    def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, str | dict):
            return [prompts]
        if prompts and all(isinstance(t, int) for t in prompts):  # one prompt as token ids
            return [prompts]  # type: ignore[list-item]
        return list(prompts)  # type: ignore[arg-type]

    def _request(self, prompt: PromptType, params: SamplingParams, priority: int, client_id: str | None) -> Request:
        tokenizer = self.executor.tokenizer
        text: str | None = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"{self.executor.description} has no tokenizer: pass prompts as token id lists")
            text, tokens = prompt, tokenizer.encode(prompt)
        else:
            tokens = list(prompt)
        request_id = f"llm-{self._counter}"
        self._counter += 1
        # it arrives now, on the engine's clock (never reset here: a later call's requests arrive later)
        return to_request(WorkloadItem(
            request_id, tokens, params, arrival_time=self.engine.clock.now(), prompt=text, priority=priority,
            client_id=client_id,
        ))

    def _logprobs(self, entries: list[TokenLogprobs | None] | None) -> list[LogprobDict | None] | None:
        if entries is None:
            return None
        tokenizer = self.executor.tokenizer
        return [
            None if entry is None else {
                t: Logprob(lp, rank, tokenizer.decode([t], skip_special_tokens=False) if tokenizer else None)
                for t, (lp, rank) in entry.items()
            }
            for entry in entries
        ]

    def _output(self, request: Request) -> RequestOutput:
        skip, tokenizer = request.params.skip_special_tokens, self.executor.tokenizer
        decode = tokenizer.decode if tokenizer is not None else None
        scored = scores_tokens(request.params)
        outputs = [
            CompletionOutput(
                c.index,
                completion_text(c, skip, decode) or "",
                c.token_ids,
                # None where the sampler computed no log-probabilities, as vLLM V1 reports it
                c.cumulative_logprob if scored else None,
                self._logprobs(c.logprobs),  # type: ignore[arg-type]
                c.finish_reason.value if c.finish_reason else None,
                c.stop_reason,
            )
            for c in request.outputs()
        ]
        metrics = RequestStateMetrics(
            request.arrival_time, request.first_scheduled_time, request.first_token_time, request.finish_time
        )
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, outputs,
            finished=request.finish_time is not None, metrics=metrics,
            prompt_logprobs=self._logprobs(request.prompt_logprobs), abort_reason=request.abort_reason,
        )
