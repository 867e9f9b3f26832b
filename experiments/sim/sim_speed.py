"""How fast the simulator runs: a 1-hour ShareGPT-like trace at 2 req/s (7,200 requests) on OPT-13B
and one A100-40GB, the paper's basic-sampling setup. Prints simulated seconds per host second.

    python experiments/sim/sim_speed.py [--requests 7200] [--rate 2] [--profile] [override ...]

`--profile` prints the engine's hottest functions (cProfile): the sim runs the same scheduler,
block manager and allocator code as the real executor, so this is where the engine's per-step
Python goes.
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import time

from rich.console import Console
from rich.table import Table

from paged.config import compose_config
from paged.engine.builder import build_engine
from paged.engine.runner import run_workload
from paged.experiment.run import workload_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=7200)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--profile", action="store_true")
    args, extra = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    cfg = compose_config([
        "executor=sim", "model=opt-13b", "hardware=a100-40g", "workload=sharegpt", "logger=none", "progress=false",
        f"workload.num_requests={args.requests}", f"workload.arrival_rate={args.rate}", *extra,
    ])
    engine = build_engine(cfg)
    items = workload_for(cfg, engine)
    profiler = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    run_workload(engine, items, progress=False)
    if profiler:
        profiler.disable()
    host = time.perf_counter() - start
    summary = engine.metrics.summary(kv_end=engine.kv_stats(), caches_prefixes=engine.caches_prefixes)
    table = Table(title=f"sim speed: {args.requests} ShareGPT-like requests at {args.rate} req/s, "
                        f"{engine.executor.description}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("simulated time (s)", f"{summary['wall_time_s']:.1f}"),
        ("host time (s)", f"{host:.2f}" + (" (profiled)" if profiler else "")),
        ("simulated s per host s", f"{summary['wall_time_s'] / host:.1f}"),
        ("engine steps", f"{summary['num_engine_steps']}"),
        ("host us per step", f"{host / summary['num_engine_steps'] * 1e6:.0f}"),
        ("mean decode batch", f"{summary['mean_decode_batch_size']:.1f}"),
        ("finished / preempted", f"{summary['num_finished']} / {summary['num_preemptions']}"),
        ("normalized latency (s/token)", f"{summary['normalized_latency_s_per_token']:.4f}"),
    ]
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
