"""Disaggregated prefill/decode on the simulator (paged/cluster/disaggregated.py): requests finish,
TTFT counts the KV copy, a decode replica admits only what its cache holds, the prefill side frees
a request's blocks only once its KV has left, and bad input is one line before anything is built."""

from __future__ import annotations

import pytest

from paged.cluster.disaggregated import DisaggregatedFleet
from paged.cluster.fleet_builder import build_fleet, check_fleet
from paged.cluster.kv_link import Placement
from paged.cluster.pools import DecodeReplica, PrefillReplica
from paged.cluster.round_robin import RoundRobinRouter
from paged.config import ConfigError, compose_config
from paged.engine.builder import build_engine
from paged.engine.metrics import MetricsRecorder
from paged.engine.runner import drive, to_request
from paged.engine.slo import goodput
from paged.experiment.run import run_quietly, workload_for
from paged.request import Request, SeqStatus

SIM = ["executor=sim", "model=llama-3-8b", "hardware=h100-sxm", "logger=none", "progress=false"]
# 256-token prompts (16 blocks of 2 MiB: Llama-3-8B's 128 KiB per token), 16 tokens out
LOAD = ["workload=fixed", "workload.prompt_len=256", "workload.output_len=16", "workload.num_requests=12",
        "workload.arrival_rate=50"]
DISAGG = ["cluster.prefill_replicas=1", "cluster.decode_replicas=2"]
# every replica on a node of its own: KV crosses the network
APART = ["hardware.gpus_per_node=1"]


def _run(*overrides: str) -> tuple[DisaggregatedFleet, list[Request]]:
    cfg = compose_config([*SIM, *LOAD, *DISAGG, *overrides])
    fleet = build_fleet(cfg)
    assert isinstance(fleet, DisaggregatedFleet)
    requests = [to_request(item) for item in workload_for(cfg, fleet)]
    fleet.clock.reset()
    drive(fleet, requests)
    return fleet, requests


def _blocks_in_use(fleet: DisaggregatedFleet) -> list[int]:
    return [r.kv_stats().num_allocated_blocks for r in fleet.replicas]


def test_every_request_finishes_once_with_its_kv_moved_and_no_block_left():
    fleet, requests = _run()
    assert all(r.finish_reason is not None and r.abort_reason is None for r in requests)
    assert all(len(r.outputs()[0].token_ids) == 16 for r in requests)
    assert _blocks_in_use(fleet) == [0, 0, 0]
    transfers = fleet.metrics.transfers
    assert sorted(t.request_id for t in transfers) == sorted(r.request_id for r in requests)
    # one node: NVLink, 16 blocks of 2 MiB each at 450 GB/s plus 10 us
    assert {(t.link, t.num_blocks, t.num_bytes) for t in transfers} == {("nvlink", 16, 16 * 2 * 1024**2)}
    assert transfers[0].transfer_s == pytest.approx(10e-6 + 16 * 2 * 1024**2 / 450e9)
    rows = fleet.replica_rows()
    assert [row["pool"] for row in rows] == ["prefill", "decode", "decode"]
    assert rows[0]["num_finished"] == 12 and rows[1]["num_finished"] + rows[2]["num_finished"] == 12
    # the metrics hold each request once, though two engines served it
    assert len(fleet.metrics.requests) == 12


def test_a_request_its_first_token_ends_finishes_on_the_prefill_side_without_a_transfer():
    fleet, requests = _run("workload.output_len=1")
    assert all(r.finish_reason is not None and r.abort_reason is None for r in requests)
    assert fleet.metrics.transfers == [] and _blocks_in_use(fleet) == [0, 0, 0]


def test_ttft_counts_the_transfer_and_tpot_does_not():
    """One request alone, across nodes: a slow network adds exactly its longer copy to TTFT."""
    one = ["workload.num_requests=1", *APART]
    slow, (slow_request,) = _run(*one, "hardware.network_bandwidth=1e9")
    fast, (fast_request,) = _run(*one, "hardware.network_bandwidth=1e15")
    (slow_copy,), (fast_copy,) = slow.metrics.transfers, fast.metrics.transfers
    assert slow_copy.link == "network" and slow_copy.transfer_s == pytest.approx(20e-6 + 16 * 2 * 1024**2 / 1e9)
    assert slow_request.kv_transfer_s == slow_copy.transfer_s
    ttft = slow_request.first_token_time - fast_request.first_token_time
    assert ttft == pytest.approx(slow_copy.transfer_s - fast_copy.transfer_s)
    decode_time = [r.finish_time - r.first_token_time for r in (slow_request, fast_request)]
    assert decode_time[0] == pytest.approx(decode_time[1])


def _tiny_decode_fleet(num_decode_blocks: int) -> DisaggregatedFleet:
    """One prefill replica with a full cache, one decode replica of `num_decode_blocks` blocks."""
    cfg = compose_config([*SIM, *LOAD, "cluster.prefill_replicas=1", "cluster.decode_replicas=1", "allocator=naive"])
    small = compose_config([*SIM, *LOAD, "allocator=naive", f"allocator.num_blocks={num_decode_blocks}"])
    metrics = MetricsRecorder()
    prefill, decode = build_engine(cfg), build_engine(small)
    prefill.metrics = decode.metrics = metrics
    return DisaggregatedFleet(
        [PrefillReplica(0, prefill)], [DecodeReplica(1, decode)], RoundRobinRouter(), RoundRobinRouter(),
        Placement(cfg.hardware, 1, 1), metrics,
    )


def test_a_small_decode_pool_admits_only_what_it_holds_and_the_rest_wait():
    # 17 blocks per request (256 + 16 tokens): two fit in 40 blocks, never three
    fleet = _tiny_decode_fleet(40)
    decode = fleet.decode[0]
    cfg = compose_config([*SIM, *LOAD])
    requests = [to_request(item) for item in workload_for(cfg, fleet)]
    for r in requests:
        r.arrival_time = 0.0
    fleet.clock.reset()
    for r in requests:
        fleet.add_request(r)
    most_waiting = most_held = 0
    while fleet.has_unfinished:
        fleet.step()
        s = decode.engine.scheduler
        held = len(s.running) + len(s.receiving)
        assert held <= 2 and decode.kv_stats().num_allocated_blocks <= 40
        most_held, most_waiting = max(most_held, held), max(most_waiting, len(decode.incoming))
    assert most_held == 2 and most_waiting >= 5
    assert all(r.finish_reason is not None and r.abort_reason is None for r in requests)
    assert _blocks_in_use(fleet) == [0, 0]
    # the requests that waited for decode memory held their KV on the prefill side meanwhile
    assert max(t.wait_s for t in fleet.metrics.transfers) > 0.1


def test_the_prefill_side_frees_a_requests_blocks_only_when_its_kv_has_left():
    cfg = compose_config([*SIM, *LOAD, *DISAGG, *APART, "hardware.network_bandwidth=1e9"])
    fleet = build_fleet(cfg)
    prefill = fleet.prefill[0]
    requests = [to_request(item) for item in workload_for(cfg, fleet)]
    fleet.clock.reset()
    held_during_copy = 0
    for r in requests:
        fleet.add_request(r)
    while fleet.has_unfinished:
        fleet.step()
        arrived = {t.request_id for t in fleet.metrics.transfers}
        for r in requests:
            (seq,) = r.seqs
            on_prefill = prefill.engine.scheduler.block_manager.has_blocks(seq)
            handed_off = seq.num_computed_tokens >= r.num_prompt_tokens and r.first_token_time is not None
            if r.request_id in arrived:
                assert not on_prefill
            elif handed_off and seq.status is SeqStatus.WAITING:
                assert on_prefill  # its KV is still being copied, or waits for the decode side
                held_during_copy += 1
    assert held_during_copy > 0 and _blocks_in_use(fleet) == [0, 0, 0]


def test_stopping_mid_run_aborts_everything_in_flight_and_frees_both_sides():
    cfg = compose_config([*SIM, *LOAD, *DISAGG, *APART, "hardware.network_bandwidth=1e8"])
    fleet = build_fleet(cfg)
    requests = [to_request(item) for item in workload_for(cfg, fleet)]
    fleet.clock.reset()
    for r in requests:
        fleet.add_request(r)
    for _ in range(40):
        fleet.step()
    assert any(e.decode is not None for e in fleet._events), "some KV should be on its way"
    aborted = fleet.abort_all("stop")
    assert not fleet.has_unfinished and _blocks_in_use(fleet) == [0, 0, 0]
    assert {r.request_id for r in aborted} == {r.request_id for r in requests if r.abort_reason is not None}
    assert all(r.finish_reason is not None for r in requests)
    assert all(r.abort_reason in (None, "stop") for r in requests) and aborted


def test_goodput_counts_the_finished_requests_that_meet_both_slos():
    out = goodput([(0.5, 0.02), (2.0, 0.02), (0.5, 0.2), (0.5, None)], 5, 2.0, slo_ttft_s=1.0, slo_tpot_s=0.05)
    assert out["goodput"] == 1.0 and out["slo_attainment"] == 0.4
    assert goodput([(0.5, 0.02)], 1, 1.0, None, None)["goodput"] is None


def test_a_run_reports_goodput_and_the_transfers():
    summary, _ = run_quietly([*SIM, *LOAD, *DISAGG, "slo.ttft_s=10", "slo.tpot_s=10"])
    assert summary["goodput"] == pytest.approx(summary["requests_per_s"]) and summary["slo_attainment"] == 1.0
    assert summary["num_kv_transfers"] == 12 and summary["kv_transfer_bytes"] == 12 * 16 * 2 * 1024**2
    assert summary["kv_transfer_mean_s"] > 0 and summary["num_replicas"] == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.prefill_replicas=2"], "disaggregation needs both pools"),
        (["cluster.decode_replicas=2"], "disaggregation needs both pools"),
        ([*DISAGG, *APART, "hardware.network_bandwidth=null"], "hardware.network_bandwidth is not given"),
        ([*DISAGG, "hardware=l4"], "gives no gpus_per_node"),
        ([*DISAGG, "hardware.gpus_per_node=3", "hardware.num_gpus=2"], "must be a positive multiple"),
        ([*DISAGG, "workload.n=2"], "one sequence per request"),
        ([*DISAGG, "slo.tpot_s=0"], "slo.tpot_s=0"),
    ],
)
def test_bad_input_is_one_line_before_anything_is_built(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        check_fleet(compose_config([*SIM, *LOAD, *overrides]))
    assert "\n" not in str(err.value)


def test_disaggregation_needs_the_simulator():
    with pytest.raises(ConfigError, match="simulated only") as err:
        check_fleet(compose_config(["model=tiny-random", "logger=none", *DISAGG]))
    assert "\n" not in str(err.value)
