"""Workloads that reuse (issue 32): Zipf prefix popularity, and the closed-loop multi-turn and agent
workloads whose follow-ups `drive` sends once the turn they follow has its reply."""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from paged.cluster.fleet_builder import build_fleet, uses_fleet
from paged.config import ConfigError, compose_config
from paged.engine.builder import build_engine, check_config
from paged.engine.runner import INTERRUPTED, drive, run_workload, to_request
from paged.experiment.run import run_experiment, run_quietly, workload_for
from paged.request import FinishReason, FollowUp, Request, SamplingParams
from paged.utils.interrupt import Interrupt
from paged.workload import WorkloadItem, load_workload

SIM = ["executor=sim", "model=llama-3-8b", "hardware=h100-sxm", "logger=none", "progress=false"]
TINY = ["model=tiny-random", "logger=none", "progress=false"]
QUICK = ["workload.arrival_rate=0", "workload.think_time_s=0.01"]  # a wall-clock run idles for no think time


class CharTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _run(overrides: list[str]) -> tuple[list[WorkloadItem], list[Request]]:
    cfg = compose_config(overrides)
    engine = build_fleet(cfg) if uses_fleet(cfg) else build_engine(cfg)
    items = workload_for(cfg, engine)
    return items, run_workload(engine, items, progress=False)


def _digest(items: list[WorkloadItem]) -> str:
    rows = [
        [i.request_id, list(i.prompt_token_ids), i.params.max_tokens, round(i.arrival_time, 9), i.client_id]
        for i in items
    ]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


# -- prefix popularity ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "tokenizer", "expected"), [
    # recorded from the code before prefix_popularity existed: the default (uniform) draws the same requests
    (["workload.shared_prefix_len=16", "workload.num_prefixes=5", "workload.arrival_rate=2.0"], None,
     "f85b4c87115a3f5a"),
    (["workload=fixed", "workload.shared_prefix_len=32", "workload.num_prefixes=3", "workload.prompt_len=64",
      "workload.output_len=8"], None, "c0d02d5284858d5f"),
    (["workload.shared_prefix_len=8", "workload.num_prefixes=4", "workload.num_clients=3",
      "workload.tenant_prefixes=true"], None, "d3c37db4be19b5fc"),
    (["workload.shared_prefix_len=12", "workload.num_prefixes=6"], CharTokenizer(), "5f0c59ddb79cc129"),
])
def test_uniform_popularity_draws_the_same_requests_as_before(overrides, tokenizer, expected):
    cfg = compose_config(["model=tiny-random", *overrides])
    assert cfg.workload.prefix_popularity == "uniform"
    items = load_workload(cfg.workload, tokenizer, vocab_size=1000, max_model_len=cfg.scheduler.max_model_len)
    assert _digest(items) == expected


def _prefix_counts(*overrides: str) -> list[int]:
    cfg = compose_config([
        "model=tiny-random", "workload.num_requests=4000", "workload.shared_prefix_len=8", "workload.num_prefixes=8",
        *overrides,
    ])
    items = load_workload(cfg.workload, None, vocab_size=5000, max_model_len=cfg.scheduler.max_model_len)
    prefixes = Counter(tuple(item.prompt_token_ids[:8]) for item in items)
    return sorted(prefixes.values(), reverse=True)


def test_zipf_popularity_skews_the_prefixes_by_its_exponent_and_is_seeded():
    uniform = _prefix_counts()
    zipf = _prefix_counts("workload.prefix_popularity=zipf")
    steep = _prefix_counts("workload.prefix_popularity=zipf", "workload.prefix_zipf_s=2.0")
    assert max(uniform) / min(uniform) < 1.3
    weights = 1 / np.arange(1, 9)
    assert zipf[0] / 4000 == pytest.approx(weights[0] / weights.sum(), abs=0.03)  # 0.368
    assert zipf[0] / zipf[-1] == pytest.approx(8, rel=0.3)
    assert steep[0] / 4000 == pytest.approx(1 / (1 / np.arange(1, 9) ** 2).sum(), abs=0.03)  # 0.654
    assert _prefix_counts("workload.prefix_popularity=zipf") == zipf
    assert _prefix_counts("workload.prefix_popularity=zipf", "workload.seed=1") != zipf


@pytest.mark.parametrize(("override", "message"), [
    ("workload.prefix_popularity=pareto",
     r"workload.prefix_popularity='pareto' is not supported; allowed: uniform, zipf"),
    ("workload.prefix_zipf_s=0", r"workload.prefix_zipf_s=0.0 must be a finite number > 0"),
    ("workload.prefix_zipf_s=-1.5", r"workload.prefix_zipf_s=-1.5 must be"),
])
def test_a_bad_popularity_is_a_one_line_error_before_the_run(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        check_config(compose_config([*SIM, override]))
    assert "\n" not in str(e.value)


# -- multi-turn and agent: the items --------------------------------------------------------------------


def test_multiturn_items_are_sessions_of_follow_ups_seeded_and_capped_by_num_requests():
    cfg = compose_config([*TINY, "workload=multiturn"])
    w = cfg.workload
    items = load_workload(w, None, vocab_size=1000, max_model_len=cfg.scheduler.max_model_len)
    assert len(items) == w.num_sessions * w.turns_per_session
    assert [i.request_id for i in items] == [f"req-{k}" for k in range(len(items))]
    for k, item in enumerate(items):
        turn = k % w.turns_per_session
        assert item.client_id == f"session-{k // w.turns_per_session}"
        assert item.follows == (None if turn == 0 else FollowUp(f"req-{k - 1}", item.follows.think_time_s))
        assert w.prompt_len_min <= len(item.prompt_token_ids) <= w.prompt_len_max
    think = [i.follows.think_time_s for i in items if i.follows is not None]
    assert np.mean(think) == pytest.approx(w.think_time_s, rel=0.5) and len(set(think)) == len(think)
    again = load_workload(w, None, vocab_size=1000, max_model_len=cfg.scheduler.max_model_len)
    assert _digest(again) == _digest(items) and [i.follows for i in again] == [i.follows for i in items]
    capped = compose_config([*TINY, "workload=multiturn", "workload.num_requests=6"]).workload
    assert [i.prompt_token_ids for i in load_workload(capped, None, vocab_size=1000)] == [
        i.prompt_token_ids for i in items[:6]
    ]


def test_a_conversation_that_would_outgrow_max_model_len_ends_early_and_says_so(caplog):
    cfg = compose_config([*TINY, "workload=multiturn", "workload.turns_per_session=10"])
    with caplog.at_level(logging.WARNING):
        items = load_workload(cfg.workload, None, vocab_size=1000, max_model_len=300)
    assert "sessions end early" in caplog.text and "scheduler.max_model_len=300" in caplog.text
    sessions = Counter(i.client_id for i in items)
    assert min(sessions.values()) < 10
    for session in sessions:
        turns = [i for i in items if i.client_id == session]
        # every reply at its full max_tokens still fits: no prompt is ever cut
        assert sum(len(i.prompt_token_ids) + i.params.max_tokens for i in turns) <= 300


def test_agents_share_one_long_context_and_each_extends_its_own_trajectory():
    cfg = compose_config([*TINY, "workload=agent"])
    w = cfg.workload
    items = load_workload(w, CharTokenizer(), max_model_len=cfg.scheduler.max_model_len)
    first = [i for i in items if i.follows is None]
    assert len(first) == w.num_sessions and {i.client_id for i in first} == {f"agent-{k}" for k in range(8)}
    assert len({tuple(i.prompt_token_ids[: w.shared_prefix_len]) for i in first}) == 1
    with pytest.raises(ConfigError, match=r"workload.shared_prefix_len=0 must be > 0 for workload=agent"):
        check_config(compose_config([*SIM, "workload=agent", "workload.shared_prefix_len=0"]))


@pytest.mark.parametrize(("override", "message"), [
    ("workload.num_sessions=0", r"workload.num_sessions=0 must be an integer >= 1"),
    ("workload.turns_per_session=0", r"workload.turns_per_session=0 must be an integer >= 1"),
    ("workload.think_time_s=-1", r"workload.think_time_s=-1.0 must be a finite number of seconds >= 0"),
    ("workload.num_clients=2", r"workload.num_clients=2 must be 0 for workload=multiturn"),
    ("workload.path=nope.csv", r"workload.path='nope.csv': no such trace file"),
])
def test_bad_session_keys_fail_before_the_run(override, message):
    with pytest.raises((ConfigError, FileNotFoundError), match=message) as e:
        check_config(compose_config([*SIM, "workload=multiturn", override]))
    assert "\n" not in str(e.value)


# -- multi-turn and agent: the runs ---------------------------------------------------------------------


def _check_follow_ups(items: list[WorkloadItem], requests: list[Request]) -> int:
    """Every follow-up's prompt is its parent's prompt + reply + its own message, and it arrived its
    think time after the parent finished; returns how many follow-ups there were."""
    by_id = {r.request_id: r for r in requests}
    count = 0
    for item, request in zip(items, requests, strict=True):
        assert request.finish_reason is FinishReason.LENGTH, request.abort_reason
        if item.follows is None:
            continue
        parent = by_id[item.follows.parent]
        reply = parent.outputs()[0].token_ids
        assert len(reply) == parent.params.max_tokens
        assert request.prompt_token_ids == parent.prompt_token_ids + reply + item.prompt_token_ids
        assert request.arrival_time == pytest.approx(parent.finish_time + item.follows.think_time_s)
        assert request.first_scheduled_time >= request.arrival_time
        count += 1
    return count


def test_multiturn_on_the_simulator_sends_each_turn_after_the_reply_with_the_conversation_so_far():
    items, requests = _run([*SIM, "workload=multiturn"])
    assert _check_follow_ups(items, requests) == 8 * 3


def test_multiturn_on_the_tiny_model_puts_its_real_replies_in_the_next_prompt():
    items, requests = _run([*TINY, "workload=multiturn", "workload.num_sessions=3", "workload.turns_per_session=3",
                            *QUICK])
    assert _check_follow_ups(items, requests) == 3 * 2
    # the replies are the model's: a reply's tokens are what it generated, not a placeholder
    assert len({tuple(r.outputs()[0].token_ids) for r in requests}) > 1


def test_agent_runs_on_the_simulator_through_a_session_fleet():
    items, requests = _run([*SIM, "workload=agent", "cluster.num_replicas=2", "router=session"])
    assert _check_follow_ups(items, requests) == 8 * 5


def test_multiturn_reuses_its_conversations_in_the_prefix_cache_best_on_one_replica_per_session():
    multiturn = [*SIM, "workload=multiturn", "allocator=prefix"]
    one, _ = run_quietly(multiturn)
    sticky, _ = run_quietly([*multiturn, "cluster.num_replicas=2", "router=session"])
    spread, _ = run_quietly([*multiturn, "cluster.num_replicas=2", "router=round-robin"])
    assert one["num_finished"] == sticky["num_finished"] == spread["num_finished"] == 32
    assert one["prefix_cache_hit_rate"] > 0.4
    assert sticky["prefix_cache_hit_rate"] == pytest.approx(one["prefix_cache_hit_rate"])
    assert spread["prefix_cache_hit_rate"] < sticky["prefix_cache_hit_rate"] - 0.1


def test_the_follow_ups_of_an_aborted_request_are_aborted_with_a_reason_and_recorded():
    cfg = compose_config(SIM)
    engine = build_engine(cfg)
    params = SamplingParams(max_tokens=4)
    items = [
        WorkloadItem("req-0", [1, 2, 3], params, error="line 1 is not valid JSON"),
        WorkloadItem("req-1", [4, 5], params, follows=FollowUp("req-0", 0.5)),
        WorkloadItem("req-2", [6], params, follows=FollowUp("req-1", 0.5)),
        WorkloadItem("req-3", [7, 8], params),
    ]
    requests = run_workload(engine, items, progress=False)
    assert requests[1].abort_reason == "follows req-0, which was aborted (line 1 is not valid JSON)"
    assert requests[2].abort_reason == f"follows req-1, which was aborted ({requests[1].abort_reason})"
    assert requests[3].finish_reason is FinishReason.LENGTH
    assert set(engine.metrics.requests) == set(requests)
    with pytest.raises(ValueError, match="'req-1' follows 'req-9', which is not among the requests before it"):
        run_workload(engine, [items[0], WorkloadItem("req-1", [4], params, follows=FollowUp("req-9"))])


def test_a_parent_aborted_in_a_run_aborts_its_follow_ups_in_requests_jsonl(tmp_path: Path):
    # n=2 needs two sequences, max_num_seqs=1 allows one: every first turn is aborted at intake
    cfg = compose_config([*SIM, "workload=multiturn", "workload.n=2", "scheduler.max_num_seqs=1"])
    summary = run_experiment(cfg, tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [row["request_id"] for row in rows] == [f"req-{k}" for k in range(32)]
    assert summary["num_aborted"] == 32
    for k, row in enumerate(rows):
        assert row["finish_reason"] == "aborted"
        if k % 4:
            assert row["abort_reason"].startswith(f"follows req-{k - 1}, which was aborted (")


def test_a_stop_aborts_the_follow_ups_of_the_interrupted():
    cfg = compose_config([*SIM, "workload=multiturn", "workload.think_time_s=0", "workload.arrival_rate=0"])
    engine, stop = build_engine(cfg), Interrupt()
    engine.metrics.step_listeners.append(lambda record: record.engine_step == 20 and stop.request())
    items = workload_for(cfg, engine)
    requests = [to_request(item) for item in items]
    assert drive(engine, requests, stop=stop) is True
    by_id = {r.request_id: r for r in requests}
    orphans = 0
    for item, request in zip(items, requests):
        parent = by_id.get(item.follows.parent) if item.follows is not None else None
        if parent is not None and parent.abort_reason is not None:
            # never left unsubmitted: aborted, with the reason its parent was
            assert request.abort_reason == f"follows {parent.request_id}, which was aborted ({parent.abort_reason})"
            assert request in engine.metrics.requests
            orphans += 1
    interrupted = sum(r.abort_reason == INTERRUPTED for r in requests)
    # every session's turn in flight was interrupted, and its later turns aborted after it
    assert interrupted == 8 and orphans > interrupted and not engine.has_unfinished
