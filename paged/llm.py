"""`LLM(...).generate(prompts, params)`: vLLM's offline API on the same engine `run.py` uses."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra import compose, initialize_config_dir

from paged.assets import asset_dir
from paged.build import build_engine
from paged.config import register_configs
from paged.engine import Engine
from paged.executor.base import Executor
from paged.request import Request, SamplingParams

CONF_DIR = asset_dir("conf")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    abort_reason: str | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []


def compose_config(overrides: Sequence[str] = ()) -> Any:
    """The same config `run.py` would see for these overrides (Hydra's compose API)."""
    if not CONF_DIR.is_dir():
        raise FileNotFoundError(f"config dir {CONF_DIR} not found; reinstall paged (pip install -e .)")
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


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
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        tokenizer = self.executor.tokenizer
        if tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ValueError(f"{self.executor.description} has no tokenizer: pass prompts as token id lists")
        requests = []
        for prompt, p in zip(prompts, params):
            text = prompt if isinstance(prompt, str) else None
            tokens = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request = Request(f"llm-{self._counter}", tokens, p, arrival_time=self.engine.clock.now(), prompt=text)
            self._counter += 1
            self.engine.add_request(request)
            requests.append(request)
        self.engine.run_until_done()
        return [self._output(r) for r in requests]

    def reset_prefix_cache(self) -> bool:
        """Drop all cached prefix blocks; False (and nothing dropped) while requests hold blocks."""
        return self.engine.scheduler.block_manager.allocator.reset_prefix_cache()

    def _decode(self, token_ids: list[int]) -> str:
        return self.executor.tokenizer.decode(token_ids) if self.executor.tokenizer is not None else ""

    def _output(self, request: Request) -> RequestOutput:
        outputs = [
            CompletionOutput(
                s.index,
                self._decode(s.output_token_ids),
                s.output_token_ids,
                s.finish_reason.value if s.finish_reason else None,
            )
            for s in sorted(request.seqs, key=lambda s: s.index)
        ]
        return RequestOutput(
            request.request_id, request.prompt, request.prompt_token_ids, outputs, request.abort_reason
        )
