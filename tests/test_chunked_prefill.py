"""Chunked prefill, batch order, prefix de-duplication and preemptive policies in the scheduling
core, on the token-cache executor (any block-table bug changes its outputs) and on the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from paged.config import ConfigError, compose_config, validate
from paged.engine.builder import build_engine
from paged.engine.engine import Engine
from paged.engine.runner import drive
from paged.request import Request, SamplingParams, SeqStatus
from paged.step import SchedulerOutput
from tests.engine_helpers import make_engine, outputs, run_requests

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
rng = np.random.default_rng(0)
PROMPTS = [rng.integers(1, 900, size=n).tolist() for n in (150, 9, 70, 33, 260, 17)]


def record_steps(engine: Engine) -> list[list[tuple[int, int, bool]]]:
    """Per step, (seq_id, num_new_tokens, is_decode) of each row, captured as it is scheduled."""
    steps: list[list[tuple[int, int, bool]]] = []
    schedule = engine.scheduler.schedule

    def recording(now: float) -> SchedulerOutput:
        out = schedule(now)
        assert out.num_decode_rows == sum(it.is_decode for it in out.scheduled)
        steps.append([(it.seq.seq_id, it.num_new_tokens, it.is_decode) for it in out.scheduled])
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return steps


def unchunked() -> list[list[list[int]]]:
    engine = make_engine("scheduler.chunked_prefill=false", "scheduler.batch_order=prefill-first")
    return outputs(run_requests(engine, PROMPTS, [GREEDY] * len(PROMPTS)))


def test_prompts_longer_than_the_budget_run_in_chunks_beside_decodes() -> None:
    engine = make_engine("scheduler.max_num_batched_tokens=64", "allocator=naive")
    steps = record_steps(engine)
    requests = run_requests(engine, PROMPTS, [GREEDY] * len(PROMPTS))
    assert outputs(requests) == unchunked()
    assert all(sum(n for _, n, _ in rows) <= 64 for rows in steps)
    longest = requests[4].seqs[0].seq_id  # 260 tokens: at least five steps of prefill
    chunks = [n for rows in steps for sid, n, decode in rows if sid == longest and not decode]
    assert sum(chunks) == 260 and len(chunks) >= 5
    # decode-first: while a prompt is chunked, the running sequences keep decoding in the same steps
    assert any(any(d for *_, d in rows) and any(not d for *_, d in rows) for rows in steps)
    mixed = [s for s in engine.metrics.steps if s.is_prefill and s.num_decode_rows]
    summary = engine.metrics.summary(kv_end=engine.kv_stats(), caches_prefixes=False)
    assert mixed and summary["mean_decode_batch_size"] > 0


def test_at_most_max_num_partial_prefills_prompts_stay_part_computed() -> None:
    for limit in (1, 2):
        # the threshold leaves budget for a second prompt's chunk, which only the limit can refuse
        engine = make_engine("scheduler.max_num_batched_tokens=48", f"scheduler.max_num_partial_prefills={limit}",
                             "scheduler.long_prefill_token_threshold=24")
        steps = record_steps(engine)
        run_requests(engine, [p for p in PROMPTS if len(p) > 48], [GREEDY] * 3)
        partial_after: list[int] = []
        progress: dict[int, int] = {}
        for rows in steps:
            for sid, n, decode in rows:
                if not decode:
                    progress[sid] = progress.get(sid, 0) + n
            lengths = {r.seqs[0].seq_id: r.num_prompt_tokens for r in engine.metrics.requests}
            partial_after.append(sum(0 < progress[s] < lengths[s] for s in progress))
        assert max(partial_after) == limit


def test_long_prefill_token_threshold_caps_each_chunk() -> None:
    engine = make_engine("scheduler.long_prefill_token_threshold=40")
    steps = record_steps(engine)
    requests = run_requests(engine, PROMPTS, [GREEDY] * len(PROMPTS))
    assert outputs(requests) == unchunked()
    assert max(n for rows in steps for _, n, _ in rows) == 40


def test_prefill_first_without_chunks_is_vllm_v0() -> None:
    engine = make_engine("scheduler.chunked_prefill=false", "scheduler.batch_order=prefill-first")
    steps = record_steps(engine)
    run_requests(engine, PROMPTS, [GREEDY] * len(PROMPTS))
    # every step is all prefill or all decode, and the prompts run whole
    assert all(len({d for *_, d in rows}) == 1 for rows in steps)
    assert sorted(n for rows in steps for _, n, d in rows if not d) == sorted(map(len, PROMPTS))


def test_prefill_first_with_chunks_admits_before_decoding() -> None:
    engine = make_engine("scheduler.batch_order=prefill-first", "scheduler.max_num_batched_tokens=64")
    steps = record_steps(engine)
    requests = run_requests(engine, PROMPTS, [GREEDY] * len(PROMPTS))
    assert outputs(requests) == unchunked()
    # a step whose prefill rows take the whole budget leaves decoding sequences waiting
    assert any(sum(n for _, n, d in rows if not d) == 64 and not any(d for *_, d in rows) for rows in steps[1:])


def test_unchunked_decode_first_mixes_whole_prompts_into_decode_steps() -> None:
    engine = make_engine("scheduler.chunked_prefill=false")
    steps = record_steps(engine)
    engine.add_request(Request("first", PROMPTS[1], GREEDY))
    engine.step()
    engine.add_request(Request("late", PROMPTS[0], GREEDY))
    drive(engine)
    assert steps[1] == [(steps[0][0][0], 1, True), (steps[1][1][0], 150, False)]


def test_without_chunks_the_budget_must_hold_the_longest_prompt() -> None:
    with pytest.raises(ConfigError, match="max_num_batched_tokens=512 must be >= scheduler.max_model_len=2048 when "
                                          "scheduler.chunked_prefill=false"):
        validate(compose_config(["scheduler.chunked_prefill=false", "scheduler.max_num_batched_tokens=512"]))
    validate(compose_config(["scheduler.max_num_batched_tokens=512"]))  # chunks make it fine


def shared_prefix_prompts(n: int = 32, prefix_len: int = 400) -> list[list[int]]:
    prefix = rng.integers(1, 900, size=prefix_len).tolist()
    return [prefix + rng.integers(1, 900, size=int(rng.integers(10, 30))).tolist() for _ in range(n)]


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "sjf", "priority"])
def test_requests_sharing_an_uncomputed_prefix_wait_to_hit_it(policy: str) -> None:
    prompts = shared_prefix_prompts()
    rates = {}
    for dedup in (True, False):
        engine = make_engine(f"scheduler={policy}", f"scheduler.prefix_dedup={dedup}", "allocator.num_blocks=2048")
        reference = outputs(run_requests(engine, prompts, [GREEDY] * len(prompts)))
        kv = engine.kv_stats()
        rates[dedup] = kv.num_hit_tokens / kv.num_queried_tokens
        assert kv.num_allocated_blocks == 0
    ideal = 31 * 400 / sum(map(len, prompts))  # only the first request computes the prefix
    assert rates[True] == pytest.approx(ideal) and rates[True] >= 0.9
    assert rates[False] < 0.75
    assert reference == outputs(run_requests(make_engine("allocator=naive"), prompts, [GREEDY] * len(prompts)))


def test_dedup_never_leaves_a_request_waiting_for_a_preempted_prefix() -> None:
    prompts = shared_prefix_prompts(8, 96)
    engine = make_engine("allocator.num_blocks=20", "scheduler.max_num_batched_tokens=64")
    requests = run_requests(engine, prompts, [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 8)
    assert all(r.finish_reason is not None and r.abort_reason is None for r in requests)
    assert sum(r.num_preemptions for r in requests) > 0
    assert not engine.scheduler.block_manager.prefix_index.computing


def test_priority_preempts_lower_priority_running_requests_for_a_waiting_one() -> None:
    engine = make_engine("scheduler=priority", "allocator.num_blocks=12", "allocator=naive")
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    low = [Request(f"low{i}", PROMPTS[3], params, priority=5) for i in range(2)]
    for r in low:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    assert all(r.seqs[0].status is SeqStatus.RUNNING for r in low)
    high = Request("high", PROMPTS[0], params, priority=0)  # 150 tokens: 10 blocks, more than are free
    engine.add_request(high)
    engine.step()
    assert high.seqs[0].status is SeqStatus.RUNNING
    assert sum(r.num_preemptions for r in low) >= 1
    drive(engine)
    alone = make_engine("allocator=naive")
    assert outputs([high, *low]) == outputs(run_requests(alone, [PROMPTS[0], PROMPTS[3], PROMPTS[3]], [params] * 3))
    # without preemption the high-priority request waits for the running ones instead
    patient = make_engine("scheduler=priority", "scheduler.policy.preempt=false", "allocator.num_blocks=12",
                          "allocator=naive")
    steps = record_steps(patient)
    for r in [Request(f"low{i}", PROMPTS[3], params, priority=5) for i in range(2)]:
        patient.add_request(r)
    for _ in range(3):
        patient.step()
    patient.add_request(Request("high", PROMPTS[0], params, priority=0))
    drive(patient)
    assert sum(r.num_preemptions for r in patient.metrics.requests) == 0
    assert all(n == 1 for rows in steps[3:30] for _, n, _ in rows)


def test_sim_runs_mixed_steps_and_chunks_long_prompts() -> None:
    cfg = compose_config([
        "executor=sim", "model=llama-2-7b", "logger=none", "progress=false", "workload=fixed",
        "workload.num_requests=16", "workload.prompt_len=1500", "workload.output_len=32",
        "workload.arrival_rate=4", "scheduler.max_num_batched_tokens=512",
    ])
    from paged.engine.runner import run_workload
    from paged.experiment.run import workload_for

    engine = build_engine(cfg)
    run_workload(engine, workload_for(cfg, engine), progress=False)
    steps = engine.metrics.steps
    assert all(s.num_scheduled_tokens <= 512 for s in steps)
    assert any(s.is_prefill and s.num_decode_rows for s in steps)
    assert sum(r.finish_reason is not None and r.abort_reason is None for r in engine.metrics.requests) == 16


def test_swap_preemption_recomputes_a_prompt_in_progress() -> None:
    # 13 blocks: two short requests decode while the newest, 150 tokens (10 blocks), is chunked 14
    # tokens a step; the first decode that needs a block preempts it before its prompt is done
    engine = make_engine("scheduler.preemption_mode=swap", "allocator=naive", "allocator.num_blocks=13",
                         "scheduler.max_num_batched_tokens=16")
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompts = [PROMPTS[1], PROMPTS[5], PROMPTS[0]]
    requests = run_requests(engine, prompts, [params] * 3)
    assert outputs(requests) == outputs(run_requests(make_engine("allocator=naive"), prompts, [params] * 3))
    assert requests[2].num_preemptions >= 1
    assert engine.scheduler.counters.num_swaps_out == 0  # recomputed, though the mode swaps
    assert engine.kv_stats().num_allocated_blocks == 0
