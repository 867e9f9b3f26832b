"""Replicas behind a router (paged/cluster): the routers' choices, a simulated fleet on one
timeline, fleet-level and per-replica summaries, and the config checks."""

from __future__ import annotations

import json

import pytest

from paged.cluster.fleet import Fleet
from paged.cluster.fleet_builder import build_fleet, uses_fleet
from paged.cluster.least_loaded import LeastLoadedRouter
from paged.cluster.prefix_aware import PrefixAwareRouter
from paged.cluster.replica import ReplicaLoad, ReplicaView
from paged.cluster.round_robin import RoundRobinRouter
from paged.cluster.sticky_session import SessionRouter
from paged.config import ConfigError, compose_config
from paged.engine.builder import build_engine
from paged.engine.runner import drive, to_request
from paged.experiment.run import run_experiment
from paged.request import Request, SamplingParams
from paged.workload import load_workload

SIM = ["executor=sim", "model=llama-3-8b", "hardware=h100-sxm", "logger=none", "progress=false"]
# 100 tenants' 256-token system prompts, 4 requests each on average, 4 replicas: a prefix's first
# request computes it, its later ones hit it only on the replica that did
SHARED = [
    "workload.num_requests=400", "workload.arrival_rate=20", "workload.shared_prefix_len=256",
    "workload.num_prefixes=100", "cluster.num_replicas=4",
]


class FakeReplica(ReplicaView):
    def __init__(self, index: int, requests: int = 0, tokens: int = 0, cached: int = 0) -> None:
        self.index, self.block_size = index, 16
        self._load = ReplicaLoad(outstanding_tokens=tokens, num_requests=requests, num_waiting=0, kv_usage=0.0)
        self.cached = cached

    def load(self) -> ReplicaLoad:
        return self._load

    def cached_prefix_blocks(self, chain: list[bytes]) -> int:
        return min(self.cached, len(chain))


def _request(i: int, prompt: list[int], client: str | None = None) -> Request:
    return Request(str(i), prompt, SamplingParams(max_tokens=4), client_id=client)


def test_round_robin_cycles_and_least_loaded_takes_the_smallest_metric():
    replicas = [FakeReplica(0, requests=3, tokens=10), FakeReplica(1, requests=1, tokens=90), FakeReplica(2, 2, 50)]
    rr = RoundRobinRouter()
    assert [rr.route(_request(i, [1]), replicas).index for i in range(5)] == [0, 1, 2, 0, 1]
    assert LeastLoadedRouter("outstanding_tokens").route(_request(0, [1]), replicas).index == 0
    assert LeastLoadedRouter("num_requests").route(_request(0, [1]), replicas).index == 1


def test_least_loaded_refuses_a_metric_replicas_do_not_report():
    with pytest.raises(ValueError, match="gpu_util.*allowed: outstanding_tokens, num_requests"):
        LeastLoadedRouter("gpu_util")


def test_prefix_aware_follows_the_cache_within_the_load_cap():
    prompt = list(range(64))  # 4 blocks
    cold, warm = FakeReplica(0, requests=2), FakeReplica(1, requests=4, cached=3)
    router = PrefixAwareRouter(balance_abs=2, balance_rel=1.0)
    assert router.route(_request(0, prompt), [cold, warm]).index == 1  # 4 <= 1.0 * 2 + 2
    busy = FakeReplica(1, requests=5, cached=3)
    assert PrefixAwareRouter(balance_abs=2, balance_rel=1.0).route(_request(0, prompt), [cold, busy]).index == 0


def test_prefix_aware_remembers_what_it_sent_before_any_block_is_computed():
    router = PrefixAwareRouter()
    replicas = [FakeReplica(0), FakeReplica(1), FakeReplica(2)]
    prefix = list(range(100, 164))
    first = router.route(_request(0, prefix + [1, 2, 3]), replicas)
    # nothing cached anywhere yet, equal loads: the second request with that prefix follows the first
    assert all(router.route(_request(i, prefix + [i]), replicas) is first for i in range(1, 5))
    # an unrelated prompt goes by load (the least-loaded, lowest index)
    assert router.route(_request(9, list(range(500, 564))), replicas).index == 0
    router.forget(first)
    assert router._sent_blocks(first.index, []) == 0


def test_session_router_keeps_a_client_on_its_first_replica_and_replaces_a_dead_one():
    replicas = [FakeReplica(0, tokens=5), FakeReplica(1, tokens=0)]
    router = SessionRouter()
    assert router.route(_request(0, [1], "a"), replicas).index == 1
    replicas[1]._load = ReplicaLoad(outstanding_tokens=100, num_requests=9, num_waiting=0, kv_usage=0.5)
    assert router.route(_request(1, [1], "a"), replicas).index == 1  # sticky despite the load
    assert router.route(_request(2, [1], "b"), replicas).index == 0
    router.forget(replicas[1])
    assert router.route(_request(3, [1], "a"), replicas[:1]).index == 0


def test_one_replica_is_a_plain_engine_and_its_summary_says_so(tmp_path):
    cfg = compose_config([*SIM, "workload.num_requests=20"])
    assert not uses_fleet(cfg)
    summary = run_experiment(cfg, tmp_path)
    assert summary["num_replicas"] == 1 and summary["router"] is None and "replicas" not in summary


def test_simulated_fleet_serves_every_request_on_one_timeline(tmp_path):
    cfg = compose_config([*SIM, *SHARED, "router=round-robin"])
    summary = run_experiment(cfg, tmp_path)
    assert summary["num_replicas"] == 4 and summary["router"] == "round-robin"
    assert summary["router_class"] == "paged.cluster.round_robin.RoundRobinRouter"
    assert summary["num_finished"] == 400 and summary["kv_blocks_in_use_end"] == 0
    rows = summary["replicas"]
    assert [r["replica"] for r in rows] == [0, 1, 2, 3] and all(r["alive"] for r in rows)
    assert [r["num_requests"] for r in rows] == [100] * 4  # round robin
    assert sum(r["num_finished"] for r in rows) == 400
    assert all(0 < r["kv_usage_mean"] <= r["kv_usage_max"] <= 1 for r in rows)
    # four pools: the summary's KV pool is all of them
    one = build_engine(compose_config(SIM)).kv_stats().num_total_blocks
    assert summary["num_total_blocks"] == 4 * one
    # arrivals at 20 req/s over 4 replicas: the fleet keeps up, so it takes about the arrival span
    assert 15 < summary["sim_time_s"] < 30
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["replicas"] == rows


def test_prefix_aware_routing_beats_round_robin_on_shared_prefixes():
    hit, ttft = {}, {}
    for router in ("round-robin", "prefix-aware"):
        fleet = build_fleet(compose_config([*SIM, *SHARED, f"router={router}"]))
        items = load_workload(compose_config([*SIM, *SHARED]).workload, None,
                              vocab_size=fleet.executor.vocab_size, max_model_len=2048)
        requests = [to_request(it) for it in items]
        fleet.clock.reset()
        drive(fleet, requests)
        assert all(r.finish_time is not None and r.abort_reason is None for r in requests)
        kv = fleet.kv_stats()
        hit[router] = kv.num_hit_tokens / kv.num_queried_tokens
        ttft[router] = sorted(r.first_token_time - r.arrival_time for r in requests)[len(requests) // 2]
    assert hit["prefix-aware"] > 1.5 * hit["round-robin"], hit
    assert ttft["prefix-aware"] < ttft["round-robin"]


def test_simulated_replicas_step_in_time_order():
    """The fleet's next step is always the earliest busy replica's, so the fleet's clock never runs
    backwards and every replica's steps start no earlier than the arrivals they serve."""
    fleet = build_fleet(compose_config([*SIM, *SHARED, "router=least-loaded"]))
    assert isinstance(fleet, Fleet)
    cfg = compose_config([*SIM, *SHARED])
    items = load_workload(cfg.workload, None, vocab_size=fleet.executor.vocab_size, max_model_len=2048)
    requests = [to_request(it) for it in items]
    seen: list[float] = []
    fleet.clock.reset()
    pending = sorted(requests, key=lambda r: r.arrival_time)
    i = 0
    while i < len(pending) or fleet.has_unfinished:
        now = fleet.clock.now()
        seen.append(now)
        while i < len(pending) and pending[i].arrival_time <= now:
            fleet.add_request(pending[i])
            i += 1
        if not fleet.has_unfinished:
            fleet.clock.wait_until(pending[i].arrival_time)
            continue
        fleet.step()
    assert seen == sorted(seen)
    assert all(r.first_scheduled_time >= r.arrival_time for r in requests)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("cluster.num_replicas=0", "cluster.num_replicas=0 must be > 0"),
        ("cluster.backend=slurm", "cluster.backend='slurm' is not supported; allowed: auto, local, ray"),
        ("cluster.prefill_replicas=2", "disaggregation needs both pools"),
        ("router.metric=gpu_util", "metric=.gpu_util. is not a load replicas report; allowed: outstanding_tokens"),
    ],
)
def test_bad_cluster_settings_are_one_line_before_anything_is_built(override, message):
    base = [*SIM, "cluster.num_replicas=2"] if "num_replicas" not in override else SIM
    extra = ["router=least-loaded"] if override.startswith("router.") else []
    cfg = compose_config([*base, *extra, override])
    with pytest.raises(ConfigError, match=message) as info:
        build_fleet(cfg)
    assert "\n" not in str(info.value)


def test_tenant_prefixes_give_each_client_its_own_prefix():
    cfg = compose_config([*SIM, "workload.num_requests=60", "workload.shared_prefix_len=32",
                          "workload.num_prefixes=4", "workload.num_clients=4", "workload.tenant_prefixes=true"])
    items = load_workload(cfg.workload, None, vocab_size=128256, max_model_len=2048)
    prefix_of: dict[str, set[tuple[int, ...]]] = {}
    for item in items:
        prefix_of.setdefault(item.client_id, set()).add(tuple(item.prompt_token_ids[:32]))
    assert len(prefix_of) == 4 and all(len(p) == 1 for p in prefix_of.values())
    assert len(set().union(*prefix_of.values())) == 4
    with pytest.raises(ConfigError, match="tenant_prefixes=true .* needs workload.num_clients > 0"):
        build_fleet(compose_config([*SIM, "cluster.num_replicas=2", "workload.tenant_prefixes=true"]))


def test_fleet_abort_frees_the_request_on_its_replica_and_the_others_finish():
    fleet = build_fleet(compose_config([*SIM, "cluster.num_replicas=2", "router=round-robin"]))
    requests = [Request(str(i), list(range(100 * i + 1, 100 * i + 301)), SamplingParams(max_tokens=40, ignore_eos=True))
                for i in range(4)]
    fleet.clock.reset()
    for request in requests:
        fleet.add_request(request)
    for _ in range(6):
        fleet.step()
    victim = requests[0]
    home, other = fleet.replicas
    assert victim in home.held and victim.finish_time is None
    held_before = home.engine.kv_stats().num_allocated_blocks
    untouched = other.engine.kv_stats().num_allocated_blocks
    fleet.abort(victim, "client disconnected")
    # its blocks are freed on its replica at once; the other replica is not touched
    assert home.engine.kv_stats().num_allocated_blocks < held_before
    assert other.engine.kv_stats().num_allocated_blocks == untouched
    while fleet.has_unfinished:
        fleet.step()
    assert victim.abort_reason == "client disconnected" and len(victim.outputs()[0].token_ids) < 40
    assert all(r.abort_reason is None and len(r.outputs()[0].token_ids) == 40 for r in requests[1:])
    assert [(r["num_finished"], r["num_aborted"]) for r in fleet.replica_rows()] == [(1, 1), (2, 0)]
    assert fleet.kv_stats().num_allocated_blocks == 0
    fleet.abort(victim, "again")  # a request no replica holds any more: nothing to do
    assert victim.abort_reason == "client disconnected"
