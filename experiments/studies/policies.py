"""The scheduling-policy catalogue compared, on the simulator (default) or the real model (--cpu).

    python experiments/studies/policies.py [--cpu] [--requests N] [--rate R] [override ...]

(a) Latency under load: every policy (and fcfs with prefill-first batching, and vLLM V0's unchunked
prefill-first) on the same ShareGPT-like Poisson stream, with 4 priority levels and two clients (one
sending 4x the requests): throughput, TTFT / TPOT / e2e percentiles, preemptions.
(b) Longest-prefix-match on a shuffled shared-prefix workload: 16 system prompts of 512 tokens,
requests interleaved, all submitted at once into a cache that holds only a few prefixes: prefix hit
rate, throughput and mean e2e latency of fcfs vs lpm.
(c) Fairness with one heavy client: two clients submit everything at once, one 4x more requests,
both more than the server runs at a time (--cpu: 8 seats); the service ratio (max/min over clients of prompt + 2 x
generated tokens served while both have requests waiting, VTC's measure) of fcfs vs fair.
Simulated runs are OPT-13B on one A100-40GB (simulated seconds); --cpu runs SmolLM2-135M here.
"""

from __future__ import annotations

import argparse
import logging

from rich.console import Console
from rich.table import Table

from paged.experiment.run import run_quietly

SIM = ["executor=sim", "model=opt-13b", "hardware=a100-40g"]
CPU = ["model=smollm2-135m", "allocator.num_blocks=512", "workload.length_scale=0.25"]
POLICIES = [
    ("fcfs", []),
    ("fcfs, prefill-first", ["scheduler=prefill-first"]),
    ("fcfs, vLLM V0 (no chunks)", ["scheduler=prefill-first", "scheduler.chunked_prefill=false"]),
    ("priority", ["scheduler=priority"]),
    ("sjf (bucket-mean)", ["scheduler=sjf"]),
    ("sjf (oracle)", ["scheduler=sjf-oracle"]),
    ("lpm", ["scheduler=lpm"]),
    ("fair (VTC)", ["scheduler=fair"]),
    ("mlfq", ["scheduler=mlfq"]),
]


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def latency(base: list[str], requests: int, rate: float, extra: list[str]) -> Table:
    load = [f"workload.num_requests={requests}", f"workload.arrival_rate={rate}", "workload.num_priorities=4",
            "workload.num_clients=2", "workload.client_weights=[4,1]"]
    table = Table(title=f"(a) {requests} requests at {rate} req/s, 4 priorities, 2 clients (4:1): latency (s)")
    cols = ["policy", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "e2e mean", "e2e p50", "e2e p99",
            "preempt."]
    for col in cols:
        table.add_column(col, justify="right")
    for label, overrides in POLICIES:
        s, _ = run_quietly([*base, *load, *overrides, *extra])
        table.add_row(label, fmt(s["requests_per_s"]), *(fmt(s[k]) for k in (
            "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_latency_mean_s", "e2e_latency_p50_s",
            "e2e_latency_p99_s")), str(s["num_preemptions"]))
    return table


def prefix_match(base: list[str], num_blocks: int, requests: int, extra: list[str]) -> Table:
    load = ["workload=synthetic", f"workload.num_requests={requests}", "workload.arrival_rate=0",
            "workload.shared_prefix_len=512", "workload.num_prefixes=16", f"allocator.num_blocks={num_blocks}"]
    table = Table(title=f"(b) {requests} requests over 16 shuffled 512-token prefixes, {num_blocks} KV blocks")
    for col in ["policy", "prefix hit rate", "req/s", "e2e mean (s)", "preemptions"]:
        table.add_column(col, justify="right")
    for policy in ("fcfs", "lpm"):  # lpm: fewer than its fcfs_above=128 waiting, so it matches prefixes
        s, _ = run_quietly([*base, *load, f"scheduler={policy}", *extra])
        table.add_row(policy, fmt(s["prefix_cache_hit_rate"]), fmt(s["requests_per_s"]),
                      fmt(s["e2e_latency_mean_s"]), str(s["num_preemptions"]))
    return table


def fairness(base: list[str], requests: int, extra: list[str], max_num_seqs: int | None = None) -> Table:
    load = [f"workload.num_requests={requests}", "workload.arrival_rate=0", "workload.num_clients=2",
            "workload.client_weights=[4,1]"]
    if max_num_seqs is not None:  # fewer seats than requests, so both clients keep some waiting
        load.append(f"scheduler.max_num_seqs={max_num_seqs}")
    table = Table(title=f"(c) {requests} requests at once from two clients (4:1): service while both wait")
    for col in ["policy", "service ratio (max/min)", "heavy e2e mean (s)", "light e2e mean (s)", "req/s"]:
        table.add_column(col, justify="right")
    for policy in ("fcfs", "fair"):
        s, engine = run_quietly([*base, *load, f"scheduler={policy}", *extra])
        e2e: dict[str, list[float]] = {}
        for r in engine.metrics.requests:
            if r.finish_time is not None and r.abort_reason is None:
                e2e.setdefault(r.client_id, []).append(r.finish_time - r.arrival_time)
        means = {c: sum(v) / len(v) for c, v in e2e.items()}
        table.add_row(policy, fmt(s["client_service_ratio"], ".2f"), fmt(means.get("client-0")),
                      fmt(means.get("client-1")), fmt(s["requests_per_s"]))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the real SmolLM2-135M on this CPU instead of the simulator")
    parser.add_argument("--requests", type=int, default=None, help="requests in (a); default 300 (sim) / 24 (cpu)")
    parser.add_argument("--rate", type=float, default=None, help="arrival rate in (a); default 3 (sim) / 2 (cpu)")
    args, extra = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=160)
    base = [*(CPU if args.cpu else SIM), "workload=sharegpt" if not args.cpu else "workload=synthetic"]
    requests = args.requests or (24 if args.cpu else 300)
    rate = args.rate or (2.0 if args.cpu else 3.0)
    console.print(latency(base, requests, rate, extra))
    console.print(prefix_match(CPU if args.cpu else SIM, 160 if args.cpu else 400, 48 if args.cpu else 120, extra))
    if args.cpu:
        console.print(fairness(base, 2 * requests, extra, max_num_seqs=8))
    else:
        console.print(fairness(base, 400, extra))


if __name__ == "__main__":
    main()
