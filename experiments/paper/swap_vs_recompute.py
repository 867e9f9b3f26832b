"""The PagedAttention paper's Fig. 19: swap vs recompute as the block size changes, on the simulator.

    python experiments/paper/swap_vs_recompute.py [--requests 1000] [--rate 2] [--tokens 2048] [override ...]

(a) Microbenchmark: moving `--tokens` tokens of KV out to the CPU and back in (vLLM's swap_blocks:
one PCIe copy per block, layer and K/V, each paying `hardware.pcie_latency_s`) against recomputing
them as one prefill, at block sizes 1..256. (b) End to end: OPT-13B, ShareGPT-like lengths at the
same request rate, `scheduler.preemption_mode` swap vs recompute, normalized latency (s/token).
The paper: recomputation wins for small blocks, swapping for large ones, comparable at 16-64.
"""

from __future__ import annotations

import argparse
import logging

from rich.console import Console
from rich.table import Table

from paged.config import compose_config
from paged.engine.builder import build_engine
from paged.experiment.run import run_quietly
from paged.sim.cost_model import StepShape

BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
E2E_BLOCK_SIZES = [8, 16, 32, 64, 128, 256]
BASE = ["executor=sim", "model=opt-13b", "hardware=a100-40g", "workload=sharegpt", "logger=none", "progress=false"]


def microbenchmark(tokens: int, extra: list[str]) -> Table:
    table = Table(title=f"(a) {tokens} tokens of OPT-13B KV on a simulated A100-40GB: swap out + in vs recompute (ms)")
    for col in ["block size", "swap out + in", "recompute", "recompute / swap"]:
        table.add_column(col, justify="right")
    executor = build_engine(compose_config([*BASE, *extra])).executor
    cost = executor.cost_model  # type: ignore[attr-defined]
    recompute = cost.step(StepShape(
        num_tokens=tokens, num_seqs=1, num_prefill_rows=1, prefill_queries=tokens, prefill_context=tokens,
        prefill_pairs=tokens * (tokens + 1) // 2, decode_contexts=[],
    ))
    recompute_s = recompute.total_s - recompute.overhead_s
    for bs in BLOCK_SIZES:
        blocks = -(-tokens // bs)
        swap_s = cost.step(StepShape(num_swap_blocks=2 * blocks, block_size=bs, decode_contexts=[])).swap_s
        table.add_row(str(bs), f"{swap_s * 1e3:.1f}", f"{recompute_s * 1e3:.1f}", f"{recompute_s / swap_s:.2f}")
    return table


def end_to_end(requests: int, rate: float, extra: list[str]) -> Table:
    table = Table(title=f"(b) OPT-13B, {requests} ShareGPT-like requests at {rate} req/s: normalized latency (s/token)")
    for col in ["block size", "recompute", "swap", "swap / recompute", "preemptions (rec / swap)", "swapped GB"]:
        table.add_column(col, justify="right")
    for bs in E2E_BLOCK_SIZES:
        results = {}
        for mode in ("recompute", "swap"):
            summary, _ = run_quietly([
                *BASE, f"workload.num_requests={requests}", f"workload.arrival_rate={rate}",
                f"allocator.block_size={bs}", f"scheduler.preemption_mode={mode}", "allocator=naive", *extra,
            ])
            results[mode] = (
                summary["normalized_latency_s_per_token"], summary["num_preemptions"], summary["swap_bytes"]
            )
        (rec, rec_pre, _), (swap, swap_pre, moved) = results["recompute"], results["swap"]
        table.add_row(str(bs), f"{rec:.3f}", f"{swap:.3f}", f"{swap / rec:.2f}", f"{rec_pre} / {swap_pre}",
                      f"{moved / 1e9:.1f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=2.0)
    parser.add_argument("--tokens", type=int, default=2048)
    args, extra = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console(width=160)
    console.print(microbenchmark(args.tokens, extra))
    console.print(end_to_end(args.requests, args.rate, extra))


if __name__ == "__main__":
    main()
