"""`LLM(...).generate(prompts, sampling_params)`, `LLM.chat` and `LLM.beam_search`: vLLM's offline
API and output records on the same engine `run.py` uses. What a call accepts is checked in
`paged.api.inputs`, what `LLM(...)` takes in `paged.api.options`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from paged.api.inputs import Prompt, check_conversations, check_params, check_prompts, render_chat, show, split_prompts
from paged.api.options import EngineArgs, llm_config
from paged.api.outputs import completion_text
from paged.engine.builder import build_engine
from paged.engine.engine import Engine
from paged.engine.runner import drive, to_request
from paged.executor.base import Executor
from paged.request import Request, SamplingParams
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
ChatMessage = dict[str, Any]
# LLM's own keyword arguments, besides vLLM's engine arguments (`EngineArgs`)
_OWN_ARGS = ("allocator", "scheduler", "kernel", "overrides", "executor")


class LLM:
    def __init__(
        self,
        model: str | os.PathLike[str] = "smollm2-135m",
        *,
        allocator: str | None = None,
        scheduler: str = "fcfs",
        kernel: str = "auto",
        overrides: Sequence[str] = (),
        executor: Executor | None = None,
        **engine_args: Any,
    ) -> None:
        """`model`: a config model name (conf/model/*.yaml), a local Hugging Face checkpoint
        directory or a .gguf file. `allocator`, `scheduler`, `kernel` choose config options (the
        allocator defaults to prefix, or naive with enable_prefix_caching=False), `overrides` are
        any further config overrides (applied last), `executor` an already built executor to
        reuse. `engine_args` are vLLM's keyword arguments (`paged.api.options.EngineArgs`:
        max_model_len, gpu_memory_utilization, dtype, seed, ...); an unknown one is a TypeError."""
        self.config = llm_config(
            model, allocator=allocator, scheduler=scheduler, kernel=kernel, overrides=overrides,
            engine_args=EngineArgs.from_kwargs(engine_args, own=_OWN_ARGS),
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
        lower first, for scheduler=priority) and `client_id` (for scheduler=fair) are per prompt.
        Every argument is checked before any prompt is submitted; an exception during the run
        (KeyboardInterrupt included) aborts this call's requests and leaves the engine idle."""
        raw = split_prompts(prompts)
        params = check_params(sampling_params, len(raw))
        checked = check_prompts(raw, self.executor.tokenizer, self.executor.vocab_size, self.executor.description)
        return self._run(checked, params, use_tqdm, priority, client_id)

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role": str, "content": str} dicts) or
        a list of them, each rendered through the tokenizer's chat template (or `chat_template`, a
        Jinja template) and generated from; one `RequestOutput` per conversation, whose `prompt` is
        the rendered text."""
        conversations = check_conversations(messages)
        params = check_params(sampling_params, len(conversations))
        prompts = render_chat(
            self.get_tokenizer(), conversations, chat_template, add_generation_prompt, self.executor.vocab_size
        )
        return self._run(prompts, params, use_tqdm, None, None)

    def beam_search(
        self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: per prompt, its `beam_width` best hypotheses, best first."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {show(params)}")
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

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (vLLM returns the same kind); ValueError where the
        model has none (a spec-only model)."""
        tokenizer = self.executor.tokenizer
        if tokenizer is None:
            raise ValueError(f"the model has no tokenizer ({self.executor.description}): prompts are token id lists")
        return getattr(tokenizer, "hf", tokenizer)

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefix blocks; False (and nothing dropped) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def _run(
        self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool,
        priority: Sequence[int] | None, client_id: Sequence[str | None] | None,
    ) -> list[RequestOutput]:
        """Submit the checked prompts and step until they are done."""
        priorities = _per_prompt("priority", priority, 0, len(prompts))
        clients = _per_prompt("client_id", client_id, None, len(prompts))
        for p in priorities:
            if isinstance(p, bool) or not isinstance(p, int):
                raise ValueError(f"priority must be an integer (lower is served first), got {p!r}")
        for c in clients:
            if c is not None and not isinstance(c, str):
                raise ValueError(f"client_id must be a string or None, got {c!r}")
        requests = [
            self._request(prompt, p, prio, client)
            for prompt, p, prio, client in zip(prompts, params, priorities, clients, strict=True)
        ]
        try:
            drive(self.engine, requests, progress=use_tqdm, label="Processed prompts")
        except BaseException as err:
            # Nothing of a failed call may linger: its requests would otherwise run first in the
            # next call. Aborting frees their blocks; the prefix cache only holds blocks of steps
            # that completed, so the next call's outputs are those of a fresh engine.
            reason = "interrupted" if isinstance(err, KeyboardInterrupt) else f"{type(err).__name__}: {err}"
            self.engine.abort_all(f"the generate call failed: {reason}")
            raise
        return [self._output(r) for r in requests]

    def _request(self, prompt: Prompt, params: SamplingParams, priority: int, client_id: str | None) -> Request:
        request_id = f"llm-{self._counter}"
        self._counter += 1
        # it arrives now, on the engine's clock (never reset here: a later call's requests arrive later)
        request = to_request(WorkloadItem(
            request_id, prompt.token_ids, params, arrival_time=self.engine.clock.now(), prompt=prompt.text,
            priority=priority, client_id=client_id,
        ))
        request.cache_salt = prompt.cache_salt
        return request

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


def _per_prompt(name: str, values: Sequence[Any] | None, default: Any, num_prompts: int) -> list[Any]:
    """A per-prompt argument as a list of one value per prompt (`default` for each when None)."""
    if values is None:
        return [default] * num_prompts
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a list of one value per prompt, got {show(values)}")
    if len(values) != num_prompts:
        raise ValueError(f"got {len(values)} {name} values for {num_prompts} prompts")
    return list(values)
