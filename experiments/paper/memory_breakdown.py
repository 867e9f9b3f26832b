"""The PagedAttention paper's Fig. 2: where KV memory goes under Orca (Max / Pow2 / Oracle) and
under paged allocation, measured every engine step and averaged.

    python experiments/paper/memory_breakdown.py sim [--requests 1000] [--rate 2] [override ...]
    python experiments/paper/memory_breakdown.py cpu [--requests 16] [override ...]

`sim`: OPT-13B on one simulated A100-40GB with ShareGPT-like lengths at the paper's load (2 req/s,
its Fig. 13 ShareGPT rate), every allocator on the same requests, plus paged allocation at saturation
(all requests at once), where its memory is as full as the baselines'. `cpu`: the real SmolLM2-135M
on this CPU with a KV cache small enough that every allocator is memory-bound. Shares are of the
whole KV pool (summary.json's `kv_*_fraction_mean`); "of used" divides token states by the memory
not free for the taking (a paged cache at low load has idle memory, which is not waste).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from rich.console import Console
from rich.table import Table

from paged.experiment.run import run_quietly

ALLOCATORS = ["orca-max", "orca-pow2", "orca-oracle", "naive"]
# Fig. 2 (token states, reservation, internal, external & others), % of KV memory
PAPER = {
    "orca-max": (20.4, 13.3, 57.3, 8.9),
    "orca-pow2": (26.8, 17.9, 13.6, 41.6),
    "orca-oracle": (38.2, 25.2, 0.0, 36.6),
    "naive": (96.3, None, None, None),
}
SHARES = ["token_state", "reserved", "internal_frag", "external_frag", "free"]


def run(overrides: list[str]) -> dict[str, Any]:
    return run_quietly(overrides)[0]


def row(label: str, s: dict[str, Any], paper: tuple[float | None, ...] | None) -> list[str]:
    shares = [100 * s[f"kv_{k}_fraction_mean"] for k in SHARES]
    used = 100 - shares[-1]
    cells = [label, *(f"{v:.1f}" for v in shares), f"{100 * shares[0] / used:.1f}" if used else "-"]
    cells.append(" / ".join("-" if v is None else f"{v:.1f}" for v in paper) if paper else "")
    cells += [f"{s['mean_decode_batch_size']:.1f}", f"{s['normalized_latency_s_per_token']:.3f}",
              str(s["num_preemptions"])]
    return cells


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", choices=["sim", "cpu"])
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--rate", type=float, default=2.0)
    args, extra = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    if args.target == "sim":
        base = ["executor=sim", "model=opt-13b", "hardware=a100-40g", "workload=sharegpt",
                f"workload.num_requests={args.requests or 1000}"]
        loads = [(a, [f"workload.arrival_rate={args.rate}"]) for a in ALLOCATORS]
        loads.append(("naive", ["workload.arrival_rate=0"]))
        title = f"OPT-13B on a simulated A100-40GB, ShareGPT-like lengths, {args.rate} req/s"
    else:
        # ShareGPT-like lengths scaled by 1/4 (clipped at 256 tokens); 48 blocks of 16 = 768 slots
        base = ["workload=sharegpt", f"workload.num_requests={args.requests or 16}", "workload.length_scale=0.25",
                "scheduler.max_model_len=256", "allocator.num_blocks=48", "allocator.block_size=16"]
        loads = [(a, ["workload.arrival_rate=0"]) for a in ALLOCATORS]
        title = "SmolLM2-135M on this CPU, ShareGPT-like lengths / 4, 768 KV slots, all requests at once"
    table = Table(title=f"KV memory breakdown (% of the pool, mean over steps): {title}")
    for col in ["allocator", "token states", "reserved", "internal frag", "external frag", "free",
                "token states % of used", "paper Fig. 2 (tok/res/int/ext)", "decode batch", "norm. latency s/tok",
                "preemptions"]:
        table.add_column(col, justify="left" if col == "allocator" else "right")
    for allocator, load in loads:
        summary = run([*base, f"allocator={allocator}", *load, *extra])
        saturated = args.target == "sim" and load[-1] == "workload.arrival_rate=0"
        label = f"{allocator} (saturated)" if saturated else allocator
        table.add_row(*row(label, summary, PAPER[allocator]))
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
