"""Replicas as Ray actors (`cluster.backend=ray`, paged/cluster/ray_fleet.py): two tiny-random replicas
on a local Ray give a single engine's greedy tokens, per-replica rows and, routed by prefix, a higher
prefix hit rate than round-robin; a replica killed mid-run loses nothing; bad input is one line before
any weights load.

Ray takes seconds to start, so the tests that run replicas share one local session (two CPUs, as
this machine has); the bad-input tests that need no session run first, before it starts."""

from __future__ import annotations

import logging
import re

import pytest
import ray

from paged.cluster.fleet_builder import build_fleet
from paged.config import ConfigError, compose_config
from paged.engine.runner import drive, to_request
from paged.experiment.run import run_quietly, workload_for
from paged.experiment.summary import summarize
from paged.utils.threads import available_cores

pytestmark = pytest.mark.subprocess

# 16 requests at once over 4 prompt prefixes of 64 tokens (4 blocks), 8 greedy tokens each
WORKLOAD = [
    "model=tiny-random", "workload.num_requests=16", "workload.shared_prefix_len=64", "workload.num_prefixes=4",
    "workload.prompt_len_mean=80", "workload.prompt_len_max=96", "workload.output_len_mean=8",
    "workload.output_len_max=8",
]
FLEET = ["cluster.num_replicas=2", "cluster.backend=ray"]
# a model file that does not exist: an error that comes after loading started would name it
NO_WEIGHTS = ["model=smollm2-135m", "model.path=/nonexistent/model.gguf", "logger=none", "progress=false"]


def tokens(requests) -> dict[str, list[int]]:
    return {r.request_id: r.outputs()[0].token_ids for r in requests}


def test_an_unreachable_cluster_address_is_one_line_before_any_weights_load() -> None:
    assert not ray.is_initialized()
    cfg = compose_config([*NO_WEIGHTS, *FLEET, "cluster.address=127.0.0.1:1"])
    with pytest.raises(ConfigError, match=r"^cluster.address='127.0.0.1:1': no Ray cluster reachable there") as e:
        build_fleet(cfg)
    assert len(str(e.value).splitlines()) == 1
    assert not ray.is_initialized()


def test_more_replicas_than_this_machine_has_cores_is_one_line_before_ray_starts() -> None:
    cores = available_cores()
    cfg = compose_config([*NO_WEIGHTS, *FLEET, f"cluster.num_cpus_per_replica={cores}"])
    with pytest.raises(ConfigError, match=rf"needs {2 * cores} CPUs, but a local Ray instance on this machine's "
                                          rf"{cores} cores has {cores}; ") as e:
        build_fleet(cfg)
    assert len(str(e.value).splitlines()) == 1
    assert not ray.is_initialized()


def test_ray_runs_real_engines_only() -> None:
    cfg = compose_config(["executor=sim", "model=opt-13b", "logger=none", *FLEET])
    with pytest.raises(ConfigError, match=r"^cluster.backend=ray runs real engines"):
        build_fleet(cfg)


@pytest.fixture(scope="module")
def session():
    """A local Ray of two CPUs for the module: each fleet joins it and leaves it running."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING,
             object_store_memory=128 * 2**20)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def single(session):
    """The same workload on one engine in this process: the tokens every fleet must give."""
    summary, engine = run_quietly(WORKLOAD)
    assert summary["num_finished"] == 16
    return tokens(engine.metrics.requests)


@pytest.fixture(scope="module")
def routed(session):
    """The workload on two replicas, per router: (summary, fleet)."""
    return {router: run_quietly([*WORKLOAD, *FLEET, f"router={router}"]) for router in ("prefix-aware", "round-robin")}


def test_more_replicas_than_the_ray_cluster_holds_is_one_line(session) -> None:
    cfg = compose_config([*NO_WEIGHTS, "cluster.num_replicas=3", "cluster.backend=ray"])
    with pytest.raises(ConfigError, match=r"^cluster.num_replicas=3 x cluster.num_cpus_per_replica=1 needs 3 CPUs, "
                                          r"but the Ray cluster this process is connected to has 2;") as e:
        build_fleet(cfg)
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.parametrize("router", ["prefix-aware", "round-robin"])
def test_two_replicas_give_one_engines_greedy_tokens_and_a_row_each(routed, single, router: str) -> None:
    summary, fleet = routed[router]
    assert summary["num_finished"] == 16 and summary["num_replicas"] == 2 and summary["router"] == router
    assert tokens(fleet.metrics.requests) == single
    rows = summary["replicas"]
    assert [r["replica"] for r in rows] == [0, 1] and all(r["alive"] for r in rows)
    assert sum(r["num_requests"] for r in rows) == sum(r["num_finished"] for r in rows) == 16
    assert all(r["num_steps"] > 0 and 0 < r["kv_usage_max"] <= 1 for r in rows)
    # every replica's steps are the fleet's, numbered across it
    assert len(fleet.metrics.steps) == sum(r["num_steps"] for r in rows)
    assert [s.engine_step for s in fleet.metrics.steps] == list(range(1, len(fleet.metrics.steps) + 1))
    assert summary["num_threads"] == 1  # each replica's torch threads: its one CPU
    assert summary["ttft_mean_s"] > 0 and summary["e2e_latency_mean_s"] >= summary["ttft_mean_s"]


def test_prefix_aware_routing_hits_the_prefix_cache_more_than_round_robin(routed) -> None:
    prefix, _ = routed["prefix-aware"]
    round_robin, _ = routed["round-robin"]
    assert prefix["prefix_cache_hit_rate"] > round_robin["prefix_cache_hit_rate"]
    rows = prefix["replicas"]
    assert all(r["prefix_cache_hit_rate"] is not None for r in rows)


def run_killing(fleet, cfg, kill_at: dict[int, int]):
    """Run the workload on `fleet`, killing replica i's actor once the fleet has recorded `kill_at[i]`
    steps (counted from the fleet's first step); returns (summary, requests)."""
    first = len(fleet.metrics.steps)

    def kill(record) -> None:
        for i, at in kill_at.items():
            if record.engine_step == first + at:
                ray.kill(fleet.replicas[i].actor, no_restart=True)

    fleet.metrics.step_listeners.append(kill)
    requests = [to_request(item) for item in workload_for(cfg, fleet)]
    fleet.clock.reset()
    drive(fleet, requests)
    fleet.metrics.step_listeners.remove(kill)
    return summarize(cfg, fleet), requests


@pytest.fixture(scope="module")
def killed(session):
    """Two round-robin replicas (one fleet: they take long to start); the test that kills one, then the
    one that kills the other, run on it in turn."""
    cfg = compose_config([*WORKLOAD, *FLEET, "router=round-robin", "logger=none", "progress=false"])
    fleet = build_fleet(cfg)
    yield cfg, fleet
    fleet.shutdown()


def test_a_killed_replicas_requests_start_again_on_the_live_one(killed, single) -> None:
    cfg, fleet = killed
    summary, requests = run_killing(fleet, cfg, {1: 3})
    dead, live = summary["replicas"][1], summary["replicas"][0]
    assert not dead["alive"] and "killed by `ray.kill`" in dead["died"] and live["alive"]
    assert dead["num_rerouted"] > 0 and dead["num_finished"] + dead["num_rerouted"] == dead["num_requests"] == 8
    assert live["num_requests"] == 8 + dead["num_rerouted"]
    assert summary["num_finished"] == summary["num_requests"] == 16 and summary["num_aborted"] == 0
    assert tokens(requests) == single


def test_with_every_replica_dead_the_rest_end_aborted_with_the_reason(killed) -> None:
    cfg, fleet = killed
    if fleet.replicas[1].alive:
        pytest.skip("runs after the test that kills replica 1")
    summary, requests = run_killing(fleet, cfg, {0: 2})
    assert not any(r["alive"] for r in summary["replicas"])
    aborted = [r for r in requests if r.abort_reason is not None]
    assert aborted and all(r.finish_reason.value == "aborted" for r in aborted)
    assert sum(r.abort_reason is None and r.finish_reason.value == "length" for r in requests) + len(aborted) == 16
    reason = r"replica 0 died \(.+\) and no replica was left to take it"
    assert all(re.fullmatch(reason, r.abort_reason) for r in aborted)
    # a request that comes once none is alive ends at once, saying so
    late = to_request(workload_for(cfg, fleet)[0])
    fleet.add_request(late)
    assert late.abort_reason == "every replica died (0, 1); none was left to take it" and not fleet.has_unfinished
