"""Swap preemption and the Orca reservation baselines through the real engine, scheduler, block
manager and allocators, with the executor that reads its context back through the paged cache (so
a block swapped to or from the wrong place changes the outputs)."""

from __future__ import annotations

import random

import pytest

from paged.config import ConfigError
from paged.engine.runner import drive
from paged.request import Request, SamplingParams
from tests.engine_helpers import make_engine, outputs, run_requests

PAGED = ["naive", "prefix"]
ORCA = ["orca-max", "orca-pow2", "orca-oracle"]
TIGHT = ("allocator.num_blocks=12", "allocator.block_size=8", "scheduler.max_model_len=96",
         "scheduler.max_num_batched_tokens=96")


def _workload(n: int = 12, seed: int = 0, n_samples: int = 1) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(900) for _ in range(rng.randint(3, 50))] for _ in range(n)]
    params = [
        SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, n=n_samples, temperature=0.0)
        for _ in range(n)
    ]
    return prompts, params


def _expected(prompts, params, allocator: str = "naive") -> list:
    return outputs(run_requests(make_engine(f"allocator={allocator}", "allocator.num_blocks=1024"), prompts, params))


def _assert_nothing_held(engine) -> None:
    s = engine.kv_stats()
    assert s.num_allocated_blocks == 0 and s.num_free_cpu_blocks == s.num_cpu_blocks
    assert not engine.scheduler.swapped


@pytest.mark.parametrize("allocator", PAGED)
def test_swap_preemption_keeps_outputs_and_moves_blocks_both_ways(allocator):
    prompts, params = _workload()
    engine = make_engine(f"allocator={allocator}", "scheduler.preemption_mode=swap", "allocator.swap_space=64KiB",
                         *TIGHT)
    requests = run_requests(engine, prompts, params)
    assert outputs(requests) == _expected(prompts, params)
    c = engine.scheduler.counters
    assert c.num_swaps_out > 0 and c.num_swaps_in == c.num_swaps_out
    assert c.num_swapped_blocks > 0 and engine.scheduler.preemption.num_recompute_fallbacks == 0
    # the token-cache executor charges 8 bytes per token slot: 64 KiB hold 1024 blocks of 8
    assert engine.kv_stats().num_cpu_blocks == 1024
    assert sum(s.num_swap_blocks for s in engine.metrics.steps) == c.num_swapped_blocks
    _assert_nothing_held(engine)


def test_swap_falls_back_to_recompute_when_the_cpu_pool_is_full():
    prompts, params = _workload()
    # 64 bytes = one block of 8 token slots: no victim fits, every preemption recomputes
    engine = make_engine("allocator=naive", "scheduler.preemption_mode=swap", "allocator.swap_space=64", *TIGHT)
    requests = run_requests(engine, prompts, params)
    assert outputs(requests) == _expected(prompts, params)
    c = engine.scheduler.counters
    fallbacks = engine.scheduler.preemption.num_recompute_fallbacks
    assert fallbacks > 0 and c.num_preemptions == c.num_swaps_out + fallbacks
    _assert_nothing_held(engine)


def test_auto_mode_swaps_requests_with_several_sequences_and_recomputes_single_ones():
    prompts, params = _workload(n=8, n_samples=3)
    single_prompts, single_params = _workload(n=6, seed=1)
    prompts += single_prompts
    params += single_params
    engine = make_engine("allocator=naive", "scheduler.preemption_mode=auto", "allocator.swap_space=64KiB",
                         "allocator.num_blocks=24", *TIGHT[1:])
    requests = run_requests(engine, prompts, params)
    assert outputs(requests) == _expected(prompts, params)
    swapped = [r for r in requests if r.params.n > 1 and r.num_preemptions]
    assert engine.scheduler.counters.num_swaps_out > 0 and swapped
    # a lone sequence is always recomputed: its preemptions never reach the swapped queue
    singles = sum(r.num_preemptions for r in requests if r.params.n == 1)
    assert engine.scheduler.counters.num_preemptions - engine.scheduler.counters.num_swaps_out >= singles
    _assert_nothing_held(engine)


def test_aborting_a_swapped_request_returns_its_cpu_blocks():
    prompts, params = _workload()
    engine = make_engine("allocator=naive", "scheduler.preemption_mode=swap", "allocator.swap_space=64KiB", *TIGHT)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(Request(f"r{i}", p, sp))
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0].request
    engine.scheduler.abort(victim, "cancelled by the client")
    drive(engine)
    assert victim.finish_reason.value == "aborted" and victim.abort_reason == "cancelled by the client"
    _assert_nothing_held(engine)


@pytest.mark.parametrize("allocator", ORCA)
def test_orca_reservations_keep_outputs_and_never_preempt(allocator):
    prompts, params = _workload()
    engine = make_engine(f"allocator={allocator}", *TIGHT[1:], "allocator.num_blocks=32")
    requests = run_requests(engine, prompts, params)
    assert outputs(requests) == _expected(prompts, params)
    assert all(r.finish_reason.value == "length" for r in requests)
    # a reservation covers the sequence's whole life: growth never needs a block
    assert engine.scheduler.counters.num_preemptions == 0
    steps = engine.metrics.steps
    assert max(s.kv_reserved_fraction for s in steps) > 0
    for s in steps:
        shares = (s.kv_token_state_fraction, s.kv_reserved_fraction, s.kv_internal_frag_fraction,
                  s.kv_external_frag_fraction, s.kv_free_fraction)
        assert all(0 <= x <= 1 for x in shares) and sum(shares) == pytest.approx(1.0)
    _assert_nothing_held(engine)


def test_breakdown_orders_the_baselines_as_the_paper():
    prompts, params = _workload(n=40, seed=3)
    means = {}
    for allocator in ["orca-max", "orca-pow2", "orca-oracle", "naive"]:
        engine = make_engine(f"allocator={allocator}", *TIGHT[1:], "allocator.num_blocks=64")
        run_requests(engine, prompts, params)
        steps = engine.metrics.steps
        means[allocator] = sum(s.kv_token_state_fraction for s in steps) / len(steps)
        if allocator == "orca-max":  # 96 slots each, for sequences that end at 4..90 tokens
            assert max(s.kv_internal_frag_fraction for s in steps) > 0.35
        if allocator == "naive":
            assert max(s.kv_external_frag_fraction for s in steps) == 0
    assert means["orca-max"] < means["orca-pow2"] <= means["orca-oracle"] < means["naive"]


def test_a_request_that_never_fits_a_contiguous_extent_is_aborted_and_the_others_finish():
    # 24 blocks = roots of 16 and 8: no extent beyond 16 blocks of 8 = 128 slots exists
    engine = make_engine("allocator=orca-oracle", "allocator.num_blocks=24", "allocator.block_size=8",
                         "scheduler.max_model_len=512", "scheduler.max_num_batched_tokens=512")
    prompts = [[1] * 20, [2] * 150, [3] * 30]
    params = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.0)] * 3
    requests = run_requests(engine, prompts, params)
    assert [r.finish_reason.value for r in requests] == ["length", "aborted", "length"]
    assert "largest contiguous extent the allocator can give is 16 blocks" in requests[1].abort_reason
    _assert_nothing_held(engine)


def test_orca_refuses_unknown_output_lengths_and_shared_samples_per_request():
    engine = make_engine("allocator=orca-oracle")
    requests = run_requests(
        engine, [[1] * 5, [2] * 5, [3] * 5],
        [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), SamplingParams(max_tokens=4, temperature=0.0),
         SamplingParams(max_tokens=4, ignore_eos=True, n=2, temperature=1.0)],
    )
    assert requests[0].finish_reason.value == "length"
    assert "ignore_eos=True" in requests[1].abort_reason
    assert "cannot share blocks between samples (best_of=2)" in requests[2].abort_reason


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("scheduler.preemption_mode=swap", "allocator.swap_space=8"),
         "allocator.swap_space='8' is smaller than one KV block"),
        (("scheduler.preemption_mode=swap", "allocator.swap_space=100000GiB"), "is more than this machine's"),
        (("scheduler.preemption_mode=swap", "allocator.swap_space=lots"),
         "allocator.swap_space='lots' is not a positive size"),
        (("scheduler.preemption_mode=swap", "allocator._target_=tests.test_block_manager.StackAllocator"),
         "needs an allocator that can swap"),
        (("scheduler.preemption_mode=sometimes",),
         "scheduler.preemption_mode='sometimes' is not supported; allowed: recompute, swap, auto"),
        (("scheduler.preemption_mode=swap", "+scheduler.preemption._target_=paged.scheduler.preemption.SwapPreemption"),
         "both choose the preemption mode"),
        (("allocator=orca-oracle", "workload.ignore_eos=false"), "set workload.ignore_eos=true"),
    ],
)
def test_bad_swap_and_reservation_settings_fail_before_the_run(overrides, message):
    with pytest.raises(ConfigError) as err:
        make_engine(*overrides)
    assert message in str(err.value)
