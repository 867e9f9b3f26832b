"""Build engines for tests from the real config groups, with the token-cache executor."""

from __future__ import annotations

from paged.config import compose_config
from paged.engine.builder import build_engine
from paged.engine.engine import Engine
from paged.engine.runner import drive
from paged.request import Request, SamplingParams
from tests.token_cache_executor import TokenCacheExecutor


def make_engine(*overrides: str) -> Engine:
    cfg = compose_config(["model=tiny-random", "logger=none", "progress=false", *overrides])
    return build_engine(cfg, executor=TokenCacheExecutor())


def run_requests(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], **kw) -> list[Request]:
    requests = [
        Request(f"r{i}", p, sp, arrival_time=0.0, **{k: v[i] for k, v in kw.items()})
        for i, (p, sp) in enumerate(zip(prompts, params))
    ]
    for r in requests:
        engine.add_request(r)
    drive(engine)
    return requests


def outputs(requests: list[Request]) -> list[list[list[int]]]:
    return [[s.output_token_ids for s in sorted(r.seqs, key=lambda s: s.index)] for r in requests]
