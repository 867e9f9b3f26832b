"""Two real replicas on Ray (`cluster.backend=ray`), routed by prefix and in turn (issue 31): the
prefix-cache hit rate of each router, and whether every request's greedy tokens are those a single
engine gives, on SmolLM2-135M on this CPU.

    python experiments/fleet/ray_routing.py [--requests 64] [--prefixes 8] [--prefix-len 256] [override ...]

The requests arrive at once, each starting with one of `--prefixes` shared prefixes (drawn at
random) followed by its own text. Each replica is a Ray actor with one CPU and one torch thread;
the single engine runs in this process on every core. Round-robin sends every prefix to both
replicas, so each computes it once; prefix-aware sends a prefix where it went before, unless that
replica holds too many more requests than the other (the router's load cap).
"""

from __future__ import annotations

import argparse
import logging

from rich.console import Console
from rich.table import Table

from paged.experiment.run import run_quietly

ROUTERS = ("prefix-aware", "round-robin")


def tokens(requests) -> dict[str, list[int]]:
    return {r.request_id: r.outputs()[0].token_ids for r in requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    args, extra = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    base = [
        "logger=none", "progress=false", "model=smollm2-135m", "workload=synthetic", "workload.temperature=0",
        f"workload.num_requests={args.requests}", f"workload.num_prefixes={args.prefixes}",
        f"workload.shared_prefix_len={args.prefix_len}", "workload.prompt_len_mean=64", "workload.prompt_len_max=128",
        "workload.length_scale=1", f"workload.output_len_min={args.output_len}",
        f"workload.output_len_max={args.output_len}", f"workload.output_len_mean={args.output_len}", *extra,
    ]
    single, engine = run_quietly(base)
    expected = tokens(engine.metrics.requests)
    rows = [("single engine (this process)", single, None)]
    for router in ROUTERS:
        summary, fleet = run_quietly([*base, "cluster.num_replicas=2", "cluster.backend=ray", f"router={router}"])
        got = tokens(fleet.metrics.requests)
        rows.append((f"2 replicas on Ray, {router}", summary, sum(got[k] == v for k, v in expected.items())))

    table = Table(title=f"SmolLM2-135M, {args.requests} requests over {args.prefixes} shared prefixes of "
                        f"{args.prefix_len} tokens, {args.output_len} greedy tokens each")
    for column in ("run", "prefix hit rate", "per replica: requests / hit rate", "same tokens as one engine",
                   "output tok/s", "TTFT mean (s)", "wall (s)"):
        table.add_column(column)
    for name, summary, same in rows:
        replicas = " | ".join(f"{r['num_requests']} / {r['prefix_cache_hit_rate']:.3f}"
                              for r in summary.get("replicas", []))
        table.add_row(
            name, f"{summary['prefix_cache_hit_rate']:.3f}", replicas or "-",
            "-" if same is None else f"{same}/{len(expected)}", f"{summary['output_tokens_per_s']:.1f}",
            f"{summary['ttft_mean_s']:.2f}", f"{summary['wall_time_s']:.1f}",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
