"""Engine overhead of each allocator and of swap bookkeeping with 64 running sequences, on the real
SmolLM2-135M on this CPU: the share of step time spent outside the model (scheduling, block
manager, batch preparation, update), from summary.json's `engine_overhead_fraction`.

    python experiments/cpu/bench_overhead.py [--requests 64] [--repeats 3] [override ...]

64 requests (prompt 64, output 64 tokens) arrive at once with max_num_seqs=64, so decode steps
run 64 sequences. The swap rows shrink the cache so that sequences are swapped out and back in.
Runs alternate between configurations; the table shows medians.
"""

from __future__ import annotations

import argparse
import logging
import statistics

from rich.console import Console
from rich.table import Table

from paged.config import compose_config
from paged.engine.builder import build_executor
from paged.experiment.run import run_quietly

BASE = ["logger=none", "progress=false", "workload=fixed", "workload.prompt_len=64", "workload.output_len=64",
        "scheduler.max_num_seqs=64", "scheduler.max_model_len=256", "scheduler.max_num_batched_tokens=4096",
        "workload.arrival_rate=0"]
CONFIGS = {
    "naive": ["allocator=naive", "allocator.num_blocks=1024"],
    "prefix": ["allocator=prefix", "allocator.num_blocks=1024"],
    "orca-max": ["allocator=orca-max", "allocator.num_blocks=1024"],
    "orca-pow2": ["allocator=orca-pow2", "allocator.num_blocks=1024"],
    "orca-oracle": ["allocator=orca-oracle", "allocator.num_blocks=1024"],
    # 64 sequences need 512 blocks of 16 at their end: 400 forces swaps
    "naive + swap": ["allocator=naive", "allocator.num_blocks=400", "scheduler.preemption_mode=swap",
                     "allocator.swap_space=1GiB"],
    "naive + recompute": ["allocator=naive", "allocator.num_blocks=400"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args, extra = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    base = [*BASE, f"workload.num_requests={args.requests}", *extra]
    executor = build_executor(compose_config(base))
    results: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for _ in range(args.repeats):
        for name, overrides in CONFIGS.items():
            summary, engine = run_quietly([*base, *overrides], executor=executor)
            steps = engine.metrics.steps
            full = [s for s in steps if not s.is_prefill and s.batch_size >= 64]
            summary["full_step_ms"] = 1e3 * statistics.median(s.step_time_s for s in full) if full else None
            summary["full_overhead"] = (
                sum(s.overhead_s for s in full) / sum(s.step_time_s for s in full) if full else None
            )
            results[name].append(summary)
    table = Table(title=f"Engine overhead, SmolLM2-135M on this CPU, {args.requests} sequences "
                        f"(medians of {args.repeats} alternating runs)")
    for col in ["configuration", "overhead, all steps", "overhead, 64-sequence decode steps",
                "64-seq decode step (ms)", "preemptions", "swaps out"]:
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for name, runs in results.items():
        def med(key: str, runs: list[dict] = runs) -> float | None:
            values = [r[key] for r in runs if r[key] is not None]
            return statistics.median(values) if values else None

        full = med("full_overhead")
        step = med("full_step_ms")
        table.add_row(
            name, f"{100 * med('engine_overhead_fraction'):.1f}%", "-" if full is None else f"{100 * full:.1f}%",
            "-" if step is None else f"{step:.0f}", f"{med('num_preemptions'):.0f}", f"{med('num_swaps_out'):.0f}",
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
