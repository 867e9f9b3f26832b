"""summary.json under vLLM benchmark_serving's names, inter-token latency from the per-step token
timestamps, the share of used KV memory that holds token states, and the requests.jsonl timing fields."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from paged.api.outputs import write_outputs
from paged.engine.engine import Engine
from paged.experiment.run import run_quietly
from paged.request import FinishReason, Request, SamplingParams
from tests.engine_helpers import make_engine, run_requests

SIM = ["executor=sim", "model=opt-13b", "hardware=a100-40g", "workload=sharegpt", "workload.num_requests=50"]
# vLLM name -> the second-based key it must agree with (x 1000)
VLLM_OF_SECONDS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e_latency"}


@pytest.fixture(scope="module")
def sim_run() -> tuple[dict[str, Any], Engine]:
    return run_quietly(SIM)


def _finished(engine: Engine) -> list[Request]:
    return [r for r in engine.metrics.requests if r.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)]


def test_vllm_latency_keys_are_the_second_based_ones_in_milliseconds(sim_run) -> None:
    summary, engine = sim_run
    assert summary["num_finished"] == 50
    for name, seconds in VLLM_OF_SECONDS.items():
        assert summary[f"mean_{name}_ms"] == pytest.approx(1000 * summary[f"{seconds}_mean_s"])
        assert summary[f"median_{name}_ms"] == pytest.approx(1000 * summary[f"{seconds}_p50_s"])
        assert summary[f"p90_{name}_ms"] == pytest.approx(1000 * summary[f"{seconds}_p90_s"])
        assert summary[f"p99_{name}_ms"] == pytest.approx(1000 * summary[f"{seconds}_p99_s"])
    metrics = [m for m in engine.metrics.request_metrics() if m.finish_reason != "aborted"]
    # population deviations, as vLLM's np.std
    assert summary["std_ttft_ms"] == pytest.approx(1000 * np.std([m.ttft_s for m in metrics]))
    assert summary["std_e2el_ms"] == pytest.approx(1000 * np.std([m.e2e_latency_s for m in metrics]))
    # a batch of 50 has spread: the deviation is not a degenerate 0
    assert summary["std_e2el_ms"] > 0


def test_vllm_counts_and_throughputs(sim_run) -> None:
    summary, engine = sim_run
    finished = _finished(engine)
    output_tokens = sum(len(r.outputs()[0].token_ids) for r in finished)
    input_tokens = sum(r.num_prompt_tokens for r in finished)
    duration = summary["duration"]
    assert duration == summary["wall_time_s"] > 0
    assert summary["completed"] == summary["num_finished"] == len(finished)
    assert summary["total_input_tokens"] == input_tokens == summary["prompt_tokens"]
    assert summary["total_output_tokens"] == output_tokens == summary["output_tokens"]
    assert summary["request_throughput"] == pytest.approx(summary["requests_per_s"])
    assert summary["output_throughput"] == pytest.approx(output_tokens / duration)
    assert summary["total_token_throughput"] == pytest.approx((input_tokens + output_tokens) / duration)


def test_one_token_timestamp_per_step_from_first_token_to_finish(sim_run) -> None:
    _, engine = sim_run
    for r in _finished(engine):
        times = np.asarray(r.token_times)
        # n = 1: one token a step, so one timestamp per output token
        assert len(times) == len(r.outputs()[0].token_ids)
        assert times[0] == r.first_token_time and times[-1] == r.finish_time
        assert np.all(np.diff(times) > 0)


def test_itl_pools_every_gap_of_every_finished_request(sim_run) -> None:
    summary, engine = sim_run
    finished = _finished(engine)
    gaps = np.concatenate([np.diff(r.token_times) for r in finished])
    assert len(gaps) == sum(len(r.token_times) - 1 for r in finished) > 1000
    # per request the gaps add up to its decode span, so the pooled mean is total span / gap count
    span = sum(r.token_times[-1] - r.token_times[0] for r in finished)
    assert summary["itl_mean_s"] * len(gaps) == pytest.approx(span)
    for q in (50, 90, 99):
        assert summary[f"itl_p{q}_s"] == pytest.approx(float(np.percentile(gaps, q)))
    # vLLM's TPOT of a request is the mean of its gaps
    for m in engine.metrics.request_metrics():
        request = next(r for r in finished if r.request_id == m.request_id)
        if m.output_len > 1:
            decode_span = request.token_times[-1] - request.token_times[0]
            assert m.tpot_s * (m.output_len - 1) == pytest.approx(decode_span)


def test_token_state_share_of_used_memory(sim_run) -> None:
    summary, engine = sim_run
    share = summary["kv_token_state_of_used_mean"]
    assert 0.0 <= share <= 1.0
    # the pool is mostly free at 1 request/s: of the whole pool little, of what is used most
    assert share > summary["kv_token_state_fraction_mean"]
    steps = [s for s in engine.metrics.steps if s.kv_free_fraction < 1.0]
    expected = np.mean([s.kv_token_state_fraction / (1.0 - s.kv_free_fraction) for s in steps])
    assert share == pytest.approx(expected)


def test_kv_pool_size_in_slots_and_bytes(sim_run) -> None:
    summary, engine = sim_run
    kv = engine.kv_stats()
    assert summary["kv_token_slots"] == summary["num_total_blocks"] * kv.block_size == kv.num_total_slots
    bytes_per_block = engine.executor.kv_cache_spec(kv.block_size).bytes_per_block
    assert summary["kv_cache_bytes"] == summary["num_total_blocks"] * bytes_per_block > 0


def test_requests_jsonl_timing_fields(sim_run, tmp_path: Path) -> None:
    summary, engine = sim_run
    write_outputs(tmp_path, summary, engine.metrics.requests, engine.metrics.request_metrics(), None)
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 50
    for line in lines:
        assert line["first_token_time"] - line["arrival_time"] == pytest.approx(line["ttft_s"])
        assert line["finish_time"] - line["arrival_time"] == pytest.approx(line["e2e_latency_s"])
        assert line["output_len"] == len(line["output_token_ids"])
        if line["output_len"] > 1:
            decode = line["e2e_latency_s"] - line["ttft_s"]
            assert line["tpot_s"] == pytest.approx(decode / (line["output_len"] - 1))
        else:
            assert line["tpot_s"] is None


def test_parallel_samples_get_one_timestamp_per_step_and_aborts_do_not_count() -> None:
    engine = make_engine("allocator.num_blocks=8", "allocator.block_size=8", "allocator.watermark=0")
    prompts = [list(range(1, 21)), [2] * 80]  # the second needs 10 blocks of 8: aborted
    params = [SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=1, ignore_eos=True),
              SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0)]
    sampled, aborted = run_requests(engine, prompts, params)
    assert aborted.finish_reason is FinishReason.ABORTED
    # three sequences a step, but a client streaming the request sees one chunk a step
    assert len(sampled.token_times) == 6
    summary = engine.metrics.summary(kv_end=engine.kv_stats(), caches_prefixes=engine.caches_prefixes)
    assert summary["completed"] == 1 and summary["num_requests"] == 2
    assert summary["total_input_tokens"] == 20
    assert summary["total_output_tokens"] == 6  # the best completion's tokens, not all three samples'
    assert summary["itl_mean_s"] == pytest.approx((sampled.token_times[-1] - sampled.token_times[0]) / 5)


def test_no_finished_request_gives_none_latencies() -> None:
    engine = make_engine()
    summary = engine.metrics.summary(kv_end=engine.kv_stats(), caches_prefixes=False)
    for name in VLLM_OF_SECONDS:
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert summary[f"{stat}_{name}_ms"] is None
    assert summary["itl_mean_s"] is None and summary["itl_p99_s"] is None
    assert summary["kv_token_state_of_used_mean"] is None
    assert summary["completed"] == summary["total_output_tokens"] == 0
    assert summary["request_throughput"] == summary["output_throughput"] == summary["total_token_throughput"] == 0.0
