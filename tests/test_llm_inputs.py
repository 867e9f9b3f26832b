"""Bad input to the LLM API (issue 30): every prompt of a call is checked before any is submitted, a
bad one fails the call in one line naming it, and a call that fails mid-run (an exception, Ctrl-C)
aborts its requests; either way the next call's outputs are those of a fresh LLM."""

from __future__ import annotations

import re

import pytest

from paged import LLM, BeamSearchParams, SamplingParams

VOCAB = 49152  # tiny-random's: the SmolLM2 vocabulary
# a shared prefix of more than a block (16 tokens), so that the prefix cache takes part
PREFIX = "Once upon a time, in a land far away, there lived a king who had three daughters and a dragon"
PROBE = [PREFIX + " and", PREFIX + " but", "Hello"]
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """What a fresh LLM answers to PROBE."""
    return [o.token_ids for o in LLM("tiny-random").generate(PROBE, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random")


def assert_as_fresh(llm: LLM, expected: list[list[int]]) -> None:
    assert not llm.engine.has_unfinished
    assert llm.engine.kv_stats().num_allocated_blocks == 0
    assert [o.token_ids for o in llm.generate(PROBE, GREEDY, use_tqdm=False)] == expected


def assert_fails(llm: LLM, call, error: type[BaseException], message: str) -> None:
    """`call(llm)` raises `error` with a one-line message containing `message`, submitting nothing."""
    submitted = len(llm.engine.metrics.requests)
    with pytest.raises(error, match=re.escape(message)) as info:
        call(llm)
    assert "\n" not in str(info.value)
    assert len(llm.engine.metrics.requests) == submitted


BAD_PROMPTS = [
    ([[10**9]], ValueError, "prompt 0: token id 1000000000 at position 0 is outside the vocabulary [0, 49152)"),
    ([[-1, 5]], ValueError, "prompt 0: token id -1 at position 0 is outside the vocabulary [0, 49152)"),
    (["fine", [5, VOCAB]], ValueError, "prompt 1: token id 49152 at position 1 is outside the vocabulary"),
    ([{"prompt_token_ids": [1, 2, 3, VOCAB + 1]}], ValueError, "prompt 0: token id 49153 at position 3"),
    (b"hello", TypeError, "prompts is bytes b'hello'; a prompt is a str, a list of int token ids"),
    (["fine", b"hello"], TypeError, "prompt 1 is bytes b'hello'; a prompt is a str"),
    (None, TypeError, "prompts is NoneType None; a prompt is a str"),
    (5, TypeError, "prompts is int 5; a prompt is a str"),
    (["fine", 3.5], TypeError, "prompt 1 is float 3.5; a prompt is a str"),
    ([[1, 2.0]], TypeError, "prompt 0: token id at position 1 is float 2.0; token ids are ints"),
    ([[1, True]], TypeError, "prompt 0: token id at position 1 is bool True; token ids are ints"),
    ([], ValueError, "prompts is empty: give at least one prompt"),
    ("", ValueError, "prompt 0 is empty: a prompt needs at least one token"),
    (["fine", []], ValueError, "prompt 1 is empty"),
    ([{"prompt_token_ids": []}], ValueError, "prompt 0 is empty"),
    ([{"prompt": "a", "prompt_token_ids": [1]}], ValueError, "prompt 0 needs exactly one of 'prompt' (a str)"),
    ([{"text": "a"}], ValueError, "prompt 0 has unknown key(s) ['text']; a dict prompt allows ['prompt'"),
    ([{"prompt": b"a"}], TypeError, "prompt 0: 'prompt' must be a str, got bytes b'a'"),
    ([{"prompt_token_ids": "abc"}], TypeError, "prompt 0: 'prompt_token_ids' must be a list of ints, got str 'abc'"),
    ([{"prompt": "a", "cache_salt": 3}], TypeError, "prompt 0: cache_salt must be a str, got int 3"),
]


@pytest.mark.parametrize(("prompts", "error", "message"), BAD_PROMPTS)
def test_bad_prompt_fails_the_call_with_nothing_submitted(llm: LLM, expected, prompts, error, message) -> None:
    assert_fails(llm, lambda m: m.generate(prompts, GREEDY, use_tqdm=False), error, message)
    assert_as_fresh(llm, expected)


@pytest.mark.parametrize(
    ("params", "error", "message"),
    [
        ({"max_tokens": 3}, TypeError, "got dict {'max_tokens': 3} (build one with SamplingParams(**...))"),
        ("greedy", TypeError, "sampling_params must be a SamplingParams, a list of them (one per prompt) or None"),
        ([GREEDY, GREEDY, {"max_tokens": 3}], TypeError, "sampling_params[2] is dict"),
        ([GREEDY], ValueError, "got 1 SamplingParams for 3 prompts"),
    ],
)
def test_bad_sampling_params_fail_the_call(llm: LLM, expected, params, error, message) -> None:
    assert_fails(llm, lambda m: m.generate(PROBE, params, use_tqdm=False), error, message)
    assert_as_fresh(llm, expected)


def test_bad_per_prompt_argument_fails_the_call(llm: LLM) -> None:
    call = lambda m: m.generate(PROBE, GREEDY, priority=5)  # noqa: E731
    assert_fails(llm, call, TypeError, "priority must be a list of one value per prompt, got int 5")


@pytest.mark.parametrize(
    ("prompts", "params", "error", "message"),
    [
        ([[10**9]], BeamSearchParams(beam_width=2, max_tokens=3), ValueError, "prompt 0: token id 1000000000"),
        ("Hello", {"beam_width": 2}, TypeError, "params must be a BeamSearchParams, got dict"),
    ],
)
def test_beam_search_checks_its_input(llm: LLM, expected, prompts, params, error, message) -> None:
    assert_fails(llm, lambda m: m.beam_search(prompts, params), error, message)
    assert_as_fresh(llm, expected)


def test_token_ids_of_any_integer_type_are_taken(llm: LLM) -> None:
    numpy = pytest.importorskip("numpy")
    ids = llm.executor.tokenizer.encode("Hello")
    as_numpy = [numpy.int64(t) for t in ids]
    assert llm.generate([as_numpy], GREEDY)[0].token_ids == llm.generate([ids], GREEDY)[0].token_ids


class Injected(Exception):
    pass


@pytest.mark.parametrize("error", [Injected, KeyboardInterrupt])
@pytest.mark.parametrize("fail_at", [1, 3], ids=["first-prefill", "mid-decode"])
def test_a_call_that_fails_mid_run_leaves_the_engine_as_a_fresh_one(
    monkeypatch: pytest.MonkeyPatch, expected, error, fail_at: int
) -> None:
    llm = LLM("tiny-random")
    execute, calls = llm.executor.execute, []

    def failing(sched):
        calls.append(sched)
        if len(calls) == fail_at:
            raise error("injected")
        return execute(sched)

    monkeypatch.setattr(llm.executor, "execute", failing)
    with pytest.raises(error):
        llm.generate(PROBE, GREEDY, use_tqdm=False)
    monkeypatch.setattr(llm.executor, "execute", execute)

    failed = llm.engine.metrics.requests
    reason = "interrupted" if error is KeyboardInterrupt else "Injected: injected"
    assert [r.abort_reason for r in failed] == [f"the generate call failed: {reason}"] * len(PROBE)
    assert all(r.finish_time is not None for r in failed)  # returned by the engine: nothing left queued
    if fail_at == 1:
        # the prefill that raised wrote no block the prefix cache could hand out later
        assert llm.engine.kv_stats().num_cached_free_blocks == 0
    hits_before = llm.engine.kv_stats().num_hit_tokens
    assert_as_fresh(llm, expected)
    # the next call runs only its own requests
    assert len(llm.engine.metrics.requests) == 2 * len(PROBE)
    if fail_at > 1:  # the blocks the failed call completed are hit, and give the same outputs
        assert llm.engine.kv_stats().num_hit_tokens > hits_before
