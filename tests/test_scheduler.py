"""Continuous batching, policies, preemption and aborts, driven through the real engine, block
manager and allocators with an executor that reads its context back through the paged cache."""

import random

import pytest

from paged.config import ConfigError
from paged.request import SamplingParams
from tests.engine_helpers import make_engine, outputs, run_requests
from tests.toy_plugins import CountingAllocator

ALLOCATORS = ["naive", "prefix"]
POLICIES = ["fcfs", "priority", "sjf"]


def _workload(n: int = 12, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(900) for _ in range(rng.randint(3, 60))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, temperature=0.0) for _ in range(n)]
    return prompts, params


@pytest.mark.parametrize("allocator", ALLOCATORS)
@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_keeps_outputs_identical_and_leaks_nothing(allocator, policy):
    prompts, params = _workload()
    roomy = make_engine(f"allocator={allocator}", f"scheduler={policy}", "allocator.num_blocks=512")
    tight = make_engine(
        f"allocator={allocator}", f"scheduler={policy}", "allocator.num_blocks=12", "allocator.block_size=8",
        "scheduler.max_model_len=96", "scheduler.max_num_batched_tokens=96",
    )
    expected = outputs(run_requests(roomy, prompts, params))
    got_requests = run_requests(tight, prompts, params)
    assert outputs(got_requests) == expected
    assert all(r.finish_reason.value == "length" for r in got_requests)
    assert tight.scheduler.counters.num_preemptions > 0
    assert sum(r.num_preemptions for r in got_requests) == tight.scheduler.counters.num_preemptions
    for engine in (roomy, tight):
        assert engine.kv_stats().num_allocated_blocks == 0


def test_prefix_caching_computes_only_uncached_tokens_with_same_outputs():
    shared = list(range(100, 164))  # four full blocks of 16
    prompts = [shared + [7, i] for i in range(6)]
    params = [SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)] * 6
    naive = make_engine("allocator=naive")
    prefix = make_engine("allocator=prefix")
    first = run_requests(prefix, prompts[:1], params[:1])
    computed_before = prefix.executor.num_computed_tokens
    rest = run_requests(prefix, prompts[1:], params[1:])
    assert outputs(first + rest) == outputs(run_requests(naive, prompts, params))
    prompt_tokens_rest = prefix.executor.num_computed_tokens - computed_before - 5 * 4
    assert prompt_tokens_rest == 5 * 2  # only the 2 unshared tokens of each later prompt
    assert prefix.kv_stats().num_hit_tokens == 5 * 64
    assert naive.executor.num_computed_tokens == 6 * 66 + 6 * 4


def test_fork_shares_prompt_blocks_and_copies_on_write():
    engine = make_engine("allocator=naive", "allocator.block_size=8")
    prompt = list(range(1, 21))  # 20 tokens: the last block is partial and shared after the fork
    params = SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=1, ignore_eos=True)
    (request,) = run_requests(engine, [prompt], [params])
    outs = outputs([request])[0]
    assert len(outs) == 3 and all(len(o) == 6 for o in outs)
    assert len({tuple(o) for o in outs}) == 3
    assert engine.kv_stats().num_allocated_blocks == 0
    reference = make_engine("allocator=naive", "allocator.block_size=8", "allocator.num_blocks=8")
    assert outputs(run_requests(reference, [prompt], [params])) == [outs]


def test_request_larger_than_cache_is_aborted_and_others_finish():
    engine = make_engine("allocator.num_blocks=4", "allocator.block_size=8", "allocator.watermark=0")
    prompts = [[1] * 10, [2] * 40, [3] * 5]
    params = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)] * 3
    requests = run_requests(engine, prompts, params)
    assert [r.finish_reason.value for r in requests] == ["length", "aborted", "length"]
    assert "needs 5 blocks" in requests[1].abort_reason and "4 blocks" in requests[1].abort_reason
    assert requests[1].finish_time is not None


def test_request_that_cannot_fit_even_into_an_idle_cache_is_aborted_not_waited_on():
    # 4 of the 8 blocks are held outside the engine: a 5-block request passes the NEVER check
    # (8 blocks in all) but can never be admitted, and must not stall the requests behind it
    engine = make_engine(
        "allocator._target_=tests.toy_plugins.HoldingAllocator", "+allocator.held=4",
        "allocator.num_blocks=8", "allocator.block_size=8", "allocator.watermark=0",
    )
    prompts = [[1] * 40, [2] * 10, [3] * 5]
    requests = run_requests(engine, prompts, [SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)] * 3)
    assert [r.finish_reason.value for r in requests] == ["aborted", "length", "length"]
    assert requests[0].abort_reason == (
        "needs 5 blocks for 40 tokens but with nothing running only 4 of the cache's 8 blocks are free"
    )


def test_invalid_requests_are_aborted_with_reasons():
    engine = make_engine("scheduler.max_model_len=32", "scheduler.max_num_batched_tokens=64")
    prompts = [[], [5] * 40, [1, 2, 3]]
    params = [SamplingParams(max_tokens=2, temperature=0.0)] * 3
    requests = run_requests(engine, prompts, params)
    assert requests[0].abort_reason == "empty prompt"
    assert "40 tokens, more than max_model_len=32" in requests[1].abort_reason
    assert requests[2].finish_reason.value == "length"
    assert engine.kv_stats().num_allocated_blocks == 0


def test_max_tokens_beyond_max_model_len_is_refused_with_the_numbers_and_stop_tokens_stop():
    engine = make_engine("scheduler.max_model_len=16", "scheduler.max_num_batched_tokens=64")
    params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=0.0) for m in (50, 6)]
    long, fits = run_requests(engine, [[1] * 10, [1] * 10], params)
    assert long.abort_reason == (
        "prompt (10 tokens) + max_tokens (50) = 60 tokens, more than max_model_len=16; max_tokens <= 6 fits"
    )
    assert fits.seqs[0].num_tokens == 16 and fits.finish_reason.value == "length"
    probe = make_engine()
    (free,) = run_requests(probe, [[4, 5, 6]], [SamplingParams(max_tokens=8, temperature=0.0)])
    stop_at = free.seqs[0].output_token_ids[3]
    stopping = SamplingParams(max_tokens=8, stop_token_ids=[stop_at], temperature=0.0)
    (stopped,) = run_requests(make_engine(), [[4, 5, 6]], [stopping])
    assert stopped.seqs[0].output_token_ids == free.seqs[0].output_token_ids[:4]
    assert stopped.finish_reason.value == "stop"


@pytest.mark.parametrize("bad", [{"max_tokens": 0}, {"max_tokens": -3}, {"top_p": 0.0}, {"n": 0}, {"temperature": -1}])
def test_bad_sampling_params_name_the_value(bad):
    key, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=f"{key} must be"):
        SamplingParams(**bad)


def test_priority_policy_admits_lowest_priority_value_first():
    engine = make_engine("scheduler=priority", "scheduler.max_num_seqs=1")
    prompts = [[1, 2], [3, 4], [5, 6]]
    params = [SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)] * 3
    requests = run_requests(engine, prompts, params, priority=[5, 0, 1])
    order = sorted(requests, key=lambda r: r.first_token_time)
    assert [r.request_id for r in order] == ["r1", "r2", "r0"]


def test_sjf_admits_shortest_prompt_first_and_aging_lets_long_ones_in():
    engine = make_engine("scheduler=sjf", "scheduler.max_num_seqs=1")
    prompts = [[1] * 30, [2] * 3, [3] * 10]
    params = [SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)] * 3
    requests = run_requests(engine, prompts, params)
    assert [r.request_id for r in sorted(requests, key=lambda r: r.first_token_time)] == ["r1", "r2", "r0"]
    policy = engine.scheduler.policy
    long_old, short_new = requests[0].seqs[0], requests[1].seqs[0]
    long_old.request.arrival_time, short_new.request.arrival_time = 0.0, 100.0
    assert policy.admission_key(long_old, now=100.0) < policy.admission_key(short_new, now=100.0)


def test_toy_allocator_and_policy_plug_in_through_config():
    CountingAllocator.calls = 0
    engine = make_engine(
        "allocator._target_=tests.toy_plugins.CountingAllocator",
        "scheduler.policy._target_=tests.toy_plugins.LongestPromptFirstPolicy",
        "scheduler.max_num_seqs=1",
    )
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)
    requests = run_requests(engine, [[1] * 3, [2] * 20], [params] * 2)
    assert CountingAllocator.calls > 0
    assert type(engine.scheduler.policy).__name__ == "LongestPromptFirstPolicy"
    assert requests[1].first_token_time < requests[0].first_token_time


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("allocator._target_=tests.toy_plugins.Nope", "allocator._target_='tests.toy_plugins.Nope' cannot be loaded"),
        ("allocator._target_=no_such_module.X", "No module named 'no_such_module'"),
        ("allocator._target_=collections.OrderedDict", "'collections.OrderedDict' is not a subclass of BlockAllocator"),
        ("scheduler.policy._target_=paged.memory.naive", "Located non-class of type 'module'"),
        ("scheduler.preemption._target_=paged.scheduler.fcfs.FCFSPolicy", "is not a subclass of PreemptionMode"),
        ("allocator.reservation._target_=''", "allocator.reservation._target_ is not set"),
    ],
)
def test_bad_plugin_paths_fail_clearly(override, message):
    with pytest.raises(ConfigError) as err:
        make_engine(override)
    assert message in str(err.value)
    assert "expected the import path of a" in str(err.value)


@pytest.mark.parametrize("packed", [False, True])
def test_intake_refuses_a_prompt_token_outside_the_vocabulary_held_as_a_list_or_packed(packed):
    """A prompt held packed beside its list (`Request.packed_prompt`) has its bounds read off the
    buffer: the same verdicts as the list's, with the first bad id and its position named."""
    from array import array

    from paged.memory import BlockManager, PrefixCachingAllocator
    from paged.request import Request
    from paged.scheduler.rejection import intake_rejection

    bm = BlockManager(PrefixCachingAllocator(num_blocks=64, block_size=4))

    def verdict(tokens: list[int]) -> str | None:
        request = Request("r", array("i", tokens) if packed else tokens, SamplingParams(max_tokens=4))
        request.expand()
        assert (request.packed_prompt is not None) == packed
        return intake_rejection(request, bm, max_model_len=64, max_num_seqs=4, has_tokenizer=False, vocab_size=100)

    assert verdict([0, 5, 99, 7]) is None
    assert verdict([3, 100, 7, 200]) == "prompt token id 100 (position 1) is outside the model's vocabulary [0, 100)"
    assert verdict([3, 4, -1]) == "prompt token id -1 (position 2) is outside the model's vocabulary [0, 100)"
