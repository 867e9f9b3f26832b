"""CPU and disk tiers for evicted prefix blocks (`allocator.offload`), on the real SmolLM2-135M on
this CPU, with the multi-turn chat workload (`workload=multiturn`: every turn re-sends the whole
conversation so far, so a session's earlier turns are its next turn's prefix).

First a run with room for everything measures the working set (the blocks of every session's last
prompt, summed) and the outputs; then the device pool is cut to a quarter of it and the workload runs
with the tiers off, with a CPU tier that holds the working set, and with a CPU tier of a quarter of
it over a disk tier that holds it. The table gives the prefix hit rate (all tiers' hits over the
prompt tokens looked up), TTFT p50 (wall seconds on this machine, noisy), the bytes moved between
the device and host memory and to and from disk, and how many requests' greedy outputs are
identical to the roomy run's and to the run with the tiers off at the same pool. (A turn's prompt
holds the model's earlier replies, so one token that differs, e.g. KV recomputed in a prefill where
the roomy run kept what decode computed, changes that session's later turns.) Run:

    python experiments/studies/kv_tiers_bench.py [--sessions 8] [--turns 4] [overrides ...]
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict

from rich.console import Console
from rich.table import Table

from paged.engine.engine import Engine
from paged.experiment.run import run_quietly

BLOCK_SIZE = 16


def outputs(engine: Engine) -> list[list[int]]:
    return [s.output_token_ids for r in engine.metrics.requests for s in r.seqs]


def working_set_blocks(engine: Engine) -> int:
    """Blocks of every session's longest prompt: what the cache must hold to recompute nothing."""
    longest: dict[str, int] = defaultdict(int)
    for r in engine.metrics.requests:
        longest[r.client_id] = max(longest[r.client_id], r.num_prompt_tokens)
    return sum(-(-n // BLOCK_SIZE) for n in longest.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("overrides", nargs="*", help="further config overrides for every run")
    args = ap.parse_args()
    base = [
        "model=smollm2-135m", "model.device=cpu", "workload=multiturn", f"workload.num_sessions={args.sessions}",
        f"workload.turns_per_session={args.turns}", "allocator=prefix", f"allocator.block_size={BLOCK_SIZE}",
        *args.overrides,
    ]
    roomy, engine = run_quietly([*base, "allocator.num_blocks=4096"])
    reference = outputs(engine)
    working_set = working_set_blocks(engine)
    bytes_per_block = engine.executor.kv_cache_spec(BLOCK_SIZE).bytes_per_block
    pool = max(working_set // 4, 1)
    small = [*base, f"allocator.num_blocks={pool}"]
    disk_path = tempfile.mkdtemp(prefix="kv-tiers-bench-")
    runs = {
        "room for all (4096 blocks)": (roomy, engine),
        "tiers off": run_quietly(small),
        "cpu (the working set)": run_quietly([*small, f"allocator.offload.cpu_bytes={working_set * bytes_per_block}"]),
        "cpu (a quarter) + disk": run_quietly([
            *small, f"allocator.offload.cpu_bytes={pool * bytes_per_block}", f"allocator.offload.disk_path={disk_path}",
            f"allocator.offload.disk_bytes={2 * working_set * bytes_per_block}",
        ]),
    }
    table = Table(title=f"KV tiers, multiturn {args.sessions} sessions x {args.turns} turns, SmolLM2-135M on CPU; "
                        f"working set {working_set} blocks, device pool {pool} blocks")
    for col in ("run", "hit rate", "hits device/cpu/disk (tokens)", "TTFT p50 (s)", "offload / onload (MiB)",
                "disk write / read (MiB)", "outputs = roomy", "outputs = tiers off"):
        table.add_column(col)
    mib = 2**20
    off = outputs(runs["tiers off"][1])

    def same(ours: list[list[int]], theirs: list[list[int]]) -> str:
        return f"{sum(a == b for a, b in zip(ours, theirs, strict=True))}/{len(theirs)}"

    for name, (s, e) in runs.items():
        table.add_row(
            name, f"{s['prefix_cache_hit_rate']:.3f}",
            f"{s['prefix_hit_tokens_device']}/{s['prefix_hit_tokens_cpu']}/{s['prefix_hit_tokens_disk']}",
            f"{s['ttft_p50_s']:.3f}", f"{s['kv_offload_bytes'] / mib:.1f} / {s['kv_onload_bytes'] / mib:.1f}",
            f"{s['kv_disk_write_bytes'] / mib:.1f} / {s['kv_disk_read_bytes'] / mib:.1f}",
            same(outputs(e), reference), same(outputs(e), off),
        )
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
