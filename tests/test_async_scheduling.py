"""Async scheduling (`scheduler.async_scheduling`, issue 43): the engine launches step N+1 before it
applies step N's tokens, which stay on the device for N+1's inputs. Greedy (and seeded) outputs are
the synchronous engine's, token for token, on the tiny random model on the CPU: with stops that a
step late discovers (stop tokens, stop strings, length), chunked prefill, preemption by recompute
and by swap while a token is in flight, and requests whose tokens cannot lag beside those that can.
Aborts and interrupts keep every token computed; a config where it cannot run is an error naming
why, before any weights load.

The model loads once; each engine re-initialises its KV cache on it.
"""

from __future__ import annotations

import pytest

from paged.config import ConfigError, compose_config
from paged.engine import builder
from paged.engine.builder import build_engine, build_executor, check_config
from paged.engine.engine import Engine
from paged.engine.runner import INTERRUPTED, drive
from paged.executor.model_executor import ModelExecutor
from paged.experiment.summary import summarize
from paged.request import FinishReason, Request, SamplingParams
from paged.utils.interrupt import Interrupt

TINY = ["model=tiny-random", "logger=none", "progress=false"]
# eight prompts of 3 to 7 distinct ids, repeated to 3..105 tokens
PROMPTS = [[1 + i, 2, 3, 4, 5, 6, 7][: 3 + i % 5] * (1 + 2 * i) for i in range(8)]
TIGHT = ("allocator.num_blocks=14", "allocator.block_size=8")  # 112 slots for ~500 tokens: preempts


@pytest.fixture(scope="module")
def executor() -> ModelExecutor:
    return build_executor(compose_config(TINY))


def engine_on(executor: ModelExecutor, async_scheduling: bool, *overrides: str) -> Engine:
    cfg = compose_config([*TINY, f"scheduler.async_scheduling={str(async_scheduling).lower()}", *overrides])
    return build_engine(cfg, executor=executor)


def requests(params: list[SamplingParams]) -> list[Request]:
    return [Request(f"r{i}", p, params[i % len(params)], arrival_time=0.0) for i, p in enumerate(PROMPTS)]


def outputs(reqs: list[Request]) -> list[list[tuple]]:
    return [[(s.output_token_ids, s.finish_reason, s.stop_reason, s.logprobs) for s in r.seqs] for r in reqs]


def run(executor: ModelExecutor, async_scheduling: bool, params: list[SamplingParams], *overrides: str
        ) -> tuple[list[list[tuple]], Engine]:
    engine = engine_on(executor, async_scheduling, *overrides)
    reqs = requests(params)
    drive(engine, reqs)
    assert not engine.has_unfinished and engine.kv_stats().num_allocated_blocks == 0
    return outputs(reqs), engine


@pytest.fixture(scope="module")
def greedy_tokens(executor) -> list[list[int]]:
    """Each request's first eight greedy tokens: stop tokens and strings are taken from them."""
    reqs = requests([SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])
    drive(engine_on(executor, False), reqs)
    return [r.seqs[0].output_token_ids for r in reqs]


def greedy(max_tokens: int | None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


SCENARIOS = {
    "lengths": (lambda t: [greedy(5 + 3 * i) for i in range(4)], ()),
    # each request stops at its own 4th token, which the host learns a step after it was sampled
    "stop-tokens": (lambda t: [greedy(12, stop_token_ids=[tokens[3]]) for tokens in t], ()),
    "min-tokens": (lambda t: [greedy(12, min_tokens=6, stop_token_ids=[tokens[3]]) for tokens in t], ()),
    "seeded": (lambda t: [SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=s) for s in range(3)], ()),
    # max_tokens=None: as many as max_model_len leaves (the longer prompts are refused, in both engines)
    "max-model-len": (lambda t: [greedy(None)], ("scheduler.max_model_len=48",)),
    "chunked-prefill": (lambda t: [greedy(10, stop_token_ids=[t[0][3]])],
                        ("scheduler.max_num_batched_tokens=16", "allocator.block_size=8")),
    "recompute": (lambda t: [greedy(24, ignore_eos=True)], TIGHT),
    "recompute-stops": (lambda t: [greedy(24, stop_token_ids=[tokens[5]]) for tokens in t[:3]], TIGHT),
    "swap": (lambda t: [greedy(24, ignore_eos=True)],
             (*TIGHT, "scheduler.preemption_mode=swap", "allocator.swap_space=16MiB")),
    "naive": (lambda t: [greedy(24)], ("allocator=naive", *TIGHT)),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_outputs_equal_the_synchronous_engine(executor, greedy_tokens, scenario) -> None:
    make_params, overrides = SCENARIOS[scenario]
    params = make_params(greedy_tokens)
    sync, sync_engine = run(executor, False, params, *overrides)
    lagged, engine = run(executor, True, params, *overrides)
    assert lagged == sync
    assert engine.async_step.num_lagged_steps > 0 and sync_engine.async_step is None
    if scenario in ("recompute", "recompute-stops", "swap", "naive"):
        assert engine.counters.num_preemptions > 0  # of sequences whose last token was in flight
    if scenario == "swap":
        assert engine.counters.num_swaps_out > 0
    if scenario == "chunked-prefill":
        assert any(s.is_prefill and s.num_decode_rows for s in engine.metrics.steps)
    if scenario == "stop-tokens":
        assert all(s[0][1] is FinishReason.STOP for s in lagged)


def test_stop_strings_found_a_step_late_end_outputs_as_the_synchronous_engine(executor, greedy_tokens) -> None:
    texts = [executor.tokenizer.decode(tokens[:6]) for tokens in greedy_tokens[:3]]
    params = [greedy(12, stop=[text[len(text) // 2 :]]) for text in texts]  # request i stops on its own
    sync, _ = run(executor, False, params)
    lagged, _ = run(executor, True, params)
    assert lagged == sync
    assert all(seqs[0][1] is FinishReason.STOP for seqs in lagged[:3])


def test_requests_whose_tokens_cannot_lag_run_synchronous_steps_beside_those_that_can(executor) -> None:
    params = [greedy(16), greedy(8, repetition_penalty=1.3), greedy(8, logprobs=2),
              SamplingParams(max_tokens=8, n=2, temperature=0.7, seed=3), greedy(16)]
    sync, _ = run(executor, False, params)
    lagged, engine = run(executor, True, params)
    assert lagged == sync
    steps = len(engine.metrics.steps)
    assert 0 < engine.async_step.num_lagged_steps < steps  # the last steps hold only lagging requests


@pytest.mark.parametrize("how", ["abort", "abort_all"])
def test_an_abort_mid_run_keeps_every_token_the_device_computed(executor, how) -> None:
    """After the same number of steps, the async engine has applied one step fewer; aborting applies
    it first, so every request holds what the synchronous engine's holds."""
    results = []
    for async_scheduling in (False, True):
        engine = engine_on(executor, async_scheduling)
        reqs = requests([greedy(6 + 4 * i) for i in range(4)])
        for r in reqs:
            engine.add_request(r)
        for _ in range(9):
            engine.step()
        if how == "abort":
            engine.abort(reqs[-1], "test")
            drive(engine)
        else:
            engine.abort_all("test")
        assert not engine.has_unfinished and engine.kv_stats().num_allocated_blocks == 0
        results.append(outputs(reqs))
    sync, lagged = results
    assert lagged == sync
    assert any(seqs[0][1] is FinishReason.ABORTED and seqs[0][0] for seqs in lagged)


def test_an_interrupt_loses_no_request_and_no_token(executor) -> None:
    params = [greedy(30, ignore_eos=True), greedy(3)]
    complete, _ = run(executor, False, params)
    engine, stop = engine_on(executor, True), Interrupt()
    engine.metrics.step_listeners.append(lambda record: record.engine_step == 6 and stop.request())
    reqs = requests(params)
    assert drive(engine, reqs, stop=stop) is True
    assert not engine.has_unfinished and engine.kv_stats().num_allocated_blocks == 0
    interrupted = 0
    for r, full in zip(reqs, complete, strict=True):
        tokens = r.seqs[0].output_token_ids
        assert r.finish_time is not None and tokens == full[0][0][: len(tokens)]
        if r.abort_reason == INTERRUPTED:
            interrupted += 1
            assert 0 < len(tokens) < 30
        else:
            assert outputs([r]) == [full]
    assert interrupted > 0


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (("executor=sim", "model=llama-3-8b"), "SimExecutor"),
        (("executor.tensor_parallel_size=2",), "executor.tensor_parallel_size=2"),
        (("workload.n=2",), "workload.n=2"),
        (("workload.n=2", "workload.use_beam_search=true"), "workload.use_beam_search=True"),
    ],
)
def test_async_scheduling_where_it_cannot_run_is_a_config_error_naming_why(overrides, names) -> None:
    cfg = compose_config([*TINY, "scheduler.async_scheduling=true", *overrides])
    with pytest.raises(ConfigError, match=rf"^scheduler\.async_scheduling=true .*{names}.*async_scheduling=false"):
        check_config(cfg)


def test_auto_is_on_for_a_cuda_model_only(monkeypatch) -> None:
    assert check_config(compose_config(TINY)).async_scheduling is False  # this machine's CPU
    monkeypatch.setattr(builder.torch.cuda, "is_available", lambda: True)
    assert check_config(compose_config(TINY)).async_scheduling is True
    for off in ("model.device=cpu", "workload.n=2", "executor.tensor_parallel_size=2"):
        assert check_config(compose_config([*TINY, off])).async_scheduling is False, off
    assert check_config(compose_config([*TINY, "executor=sim", "model=llama-3-8b"])).async_scheduling is False


def test_the_description_and_summary_say_async_scheduling_is_on(executor) -> None:
    cfg = compose_config([*TINY, "scheduler.async_scheduling=true"])
    engine = build_engine(cfg, executor=executor)
    drive(engine, requests([greedy(3)]))
    assert "async scheduling" in executor.description
    assert summarize(cfg, engine)["async_scheduling"] is True
    off = compose_config(TINY)
    engine = build_engine(off, executor=executor)
    assert "async scheduling" not in executor.description
    assert summarize(off, engine)["async_scheduling"] is False
