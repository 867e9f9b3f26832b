"""What a lagging fleet replica's open window tells before its steps run (`window_horizon`): a
lower bound of its end, and whether a router's prefix read could change in it. Each answer is
checked against the window's steps run for real."""

from __future__ import annotations

import math
import random

import pytest

from paged.config import compose_config
from paged.engine.builder import build_engine
from paged.engine.engine import Engine
from paged.engine.fast_forward import FastForward
from paged.engine.window_horizon import steps_left
from paged.memory.hashing import prompt_block_hashes
from paged.request import Request, SamplingParams
from paged.sim.executor import plain_token

SIM = ["executor=sim", "model=llama-3-8b", "hardware=h100-sxm", "logger=none", "progress=false",
       "allocator=prefix", "scheduler.max_model_len=2048"]
PROMPT = list(range(1000, 1040))  # 2 full blocks of 16 and 8 tokens of a third


def _engine(*overrides: str) -> tuple[Engine, FastForward]:
    engine = build_engine(compose_config([*SIM, *overrides]))
    engine.metrics.keep_steps = False  # as a run's: a call runs every window step up to its horizon
    engine.clock.reset()
    assert isinstance(engine.fast_forward, FastForward)
    return engine, engine.fast_forward


def _decoding(engine: Engine, prompt: list[int], max_tokens: int = 64, **params: object) -> Request:
    """A request past its prefill step: its next steps are a window's."""
    request = Request(f"r{len(engine.scheduler.running)}-{prompt[0]}", list(prompt),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, **params))  # type: ignore[arg-type]
    engine.add_request(request)
    engine.step()
    assert request.seqs[0].num_computed_tokens == len(prompt)
    return request


def _future(engine: Engine, request: Request, k: int) -> list[int]:
    """The next `k` tokens its window samples (greedy `plain_token`)."""
    tokens = list(request.seqs[0].token_ids)
    vocab = engine.executor.vocab_size
    for _ in range(k):
        tokens.append(plain_token(tokens[-1], len(tokens), vocab, True, 0))
    return tokens


def _cached(engine: Engine, tokens: list[int]) -> tuple[list[bytes], int]:
    chain = prompt_block_hashes(tokens, engine.block_size, None)
    return chain, engine.cached_prefix_blocks(chain)


def test_a_block_a_row_will_publish_is_a_change() -> None:
    engine, ff = _engine()
    request = _decoding(engine, PROMPT)
    ff.horizon(engine)  # plans the window
    # a prompt that goes on as the row's own next tokens: the row fills and publishes its blocks
    chain, matched = _cached(engine, _future(engine, request, 24))
    assert matched == 2 and len(chain) == 4 and not ff.prefix_unchanged(engine, chain, matched)
    engine.step(math.inf)
    assert engine.cached_prefix_blocks(chain) == 4


def test_a_prompt_that_parts_from_every_row_early_is_no_change() -> None:
    engine, ff = _engine()
    _decoding(engine, PROMPT)
    ff.horizon(engine)
    chain, matched = _cached(engine, [*PROMPT[:16], *range(5000, 5040)])
    assert matched == 1 and ff.prefix_unchanged(engine, chain, matched)
    engine.step(math.inf)
    assert engine.cached_prefix_blocks(chain) == 1


@pytest.mark.parametrize(("num_blocks", "evicted"), [(9, True), (64, False)])
def test_a_free_cached_block_is_a_change_only_where_the_window_may_evict(num_blocks: int, evicted: bool) -> None:
    engine, ff = _engine(f"allocator.num_blocks={num_blocks}")
    done = _decoding(engine, list(range(7000, 7032)), max_tokens=1)  # finishes: its 2 blocks cached, free
    assert done.finish_time is not None
    _decoding(engine, PROMPT, max_tokens=80)
    ff.horizon(engine)
    chain, matched = _cached(engine, list(range(7000, 7032)))
    assert matched == 2
    assert ff.prefix_unchanged(engine, chain, matched) is not evicted
    while engine.has_unfinished:
        engine.step(math.inf)
    assert (engine.cached_prefix_blocks(chain) < matched) is evicted


def test_the_horizon_bounds_the_window_and_finds_its_stop() -> None:
    engine, ff = _engine()
    request = _decoding(engine, PROMPT)
    stop = _future(engine, request, 12)[-1]  # the 12th token it samples next ends it there
    engine.abort(request, "test")
    engine.step()
    request = _decoding(engine, PROMPT, stop_token_ids=[stop])
    horizon = ff.horizon(engine)
    window = ff._window
    assert window is not None and steps_left(window, engine.executor.vocab_size) == 11
    assert engine.clock.now() < horizon
    assert ff.step(engine, math.inf)
    assert ff.num_steps == 11 and engine.clock.now() >= horizon
    assert not ff.step(engine, math.inf)  # the stopping step is the engine's own


@pytest.mark.parametrize("overrides", [
    ["model=llama-3-8b", "hardware=h100-sxm", "kernel=vllm"],
    ["model=opt-13b", "hardware=a100-40g"],
    ["model=llama-3-70b", "hardware=h100-sxm", "hardware.num_gpus=4"],
])
def test_the_cost_floor_is_below_every_step(overrides: list[str]) -> None:
    executor = build_engine(compose_config([*SIM, *overrides])).executor
    rng = random.Random(0)
    for n in (1, 2, 5, 17, 64):
        floor = executor.decode_floor(n)
        for _ in range(20):
            contexts = [rng.randint(1, 2000) for _ in range(n)]
            assert floor < executor.decode_cost(contexts).total_s
