"""The PagedAttention paper's memory-sharing study (Fig. 14, 15): how much KV memory parallel
sampling and beam search save by sharing blocks, and what sharing costs or gains on a real model.

    python experiments/paper/sharing.py sim [--alpaca 600 30] [--sharegpt 150 2] [--widths 2 4 6] [--out F]
        [override ...]
    python experiments/paper/sharing.py cpu [--prompts 8] [--width 4] [--max-tokens 32] [--repeats 3] [--out F]
        [override ...]

`sim`: OPT-13B on one simulated A100-40GB (the paper's setup), naive block allocator (sharing between
a request's own sequences only, no prefix cache), Alpaca- and ShareGPT-like lengths (log-normal fits
to the paper's mean lengths) with Poisson arrivals: `--alpaca REQUESTS RATE` and `--sharegpt
REQUESTS RATE` set the load. Each request samples n = 2, 4, 6 sequences (parallel sampling,
temperature 1) or runs beam search of that width (temperature 0). The scheduler runs as the
paper's vLLM did: up to 256 sequences (`scheduler.max_num_seqs`, vLLM's default) and vLLM V0's
preemption rule (`scheduler.preemption_mode=auto`: swap a request with several sequences, so a
preempted group keeps its sharing; recompute a lone one). The saving is summary.json's
`kv_sharing_saving_mean`: per engine step, 1 - distinct blocks held / block-table entries (blocks
saved by sharing / blocks without sharing), averaged over the steps in which sequences hold
blocks. The paper gives per-width numbers for Alpaca; for ShareGPT only the span over widths 2..6,
so its ends stand for widths 2 and 6 (the saving grows with the width) and width 4 is compared with
the whole span. Beside it: the same saving weighted by step time, and over the steps at capacity
(requests queued for a seat or memory), since the plain step mean counts the many short steps of
the drain (a few long requests left) as much as full batches; `--out` also keeps it per tenth of
the run's time. Every run is deterministic: seeded lengths and arrivals, and the simulator's
placeholder tokens and beam log-probabilities are hashes (paged/sim/executor.py). The
defaults keep each run under ~15 s here with the queue or the memory full for most of the run.

`cpu`: the real SmolLM2-135M on this CPU, beam search of `--width` over `--prompts` short prompts,
`--max-tokens` tokens each (EOS ignored, so every run does the same work), with block sharing
(`allocator.share_blocks=true`) and the paper's no-sharing baseline (false: a beam copies every
block it shares before its next step). One loaded model serves every run, so loading is not timed.
After an untimed warm-up of each, the two settings alternate (on, off, off, on, ...) over
`--repeats` to spread this machine's noise over both; the table gives medians, the median of the
per-repeat throughput ratios, and whether every run returned the same hypotheses token for token
(both settings do the same computation). Peak KV blocks is the most blocks allocated after any
step. The baseline's saving is not 0: a step's forks are recorded after the step and are copied
only before the next one.

`--out F` writes every run's row (and, for `sim`, its whole summary) as JSON, or as CSV when F ends
in .csv. Extra `key=value` arguments are Hydra overrides applied to every run.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from paged.api.llm import LLM
from paged.config import compose_config
from paged.engine.builder import build_executor
from paged.engine.metrics import StepRecord
from paged.experiment.run import run_quietly
from paged.experiment.summary import summarize
from paged.request import SamplingParams

WIDTHS = [2, 4, 6]
MODES = ["parallel", "beam"]
# Fig. 15 / Sec. 6.3, memory saving in %: per width for Alpaca, the span over widths 2..6 for ShareGPT
PAPER: dict[tuple[str, str], dict[int, float] | tuple[float, float]] = {
    ("alpaca", "parallel"): {2: 6.09, 4: 8.53, 6: 9.79},
    ("alpaca", "beam"): {2: 37.56, 4: 53.13, 6: 55.16},
    ("sharegpt", "parallel"): (16.2, 30.5),
    ("sharegpt", "beam"): (44.3, 66.3),
}
SIM_BASE = [
    "executor=sim", "model=opt-13b", "hardware=a100-40g", "allocator=naive", "logger=none", "progress=false",
    # vLLM's defaults, which the paper's system ran with (this repo's fcfs.yaml caps at 64 sequences)
    "scheduler.max_num_seqs=256", "scheduler.preemption_mode=auto",
]
# Short instructions, Alpaca-like; the `cpu` run takes the first --prompts of them (cycling if more)
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence why the sky is blue.",
    "Give two tips for staying healthy.",
    "Translate 'good morning' into Spanish.",
    "Describe a cat to someone who has never seen one.",
    "What does a compiler do?",
    "Name three planets of the solar system.",
    "Summarize the plot of Romeo and Juliet in one sentence.",
    "Why do leaves change color in autumn?",
    "Suggest a name for a bakery.",
]


def paper_value(workload: str, mode: str, width: int) -> tuple[str, float | None, tuple[float, float] | None]:
    """The paper's number as printed, and the point value or span the measurement is compared with."""
    ref = PAPER[(workload, mode)]
    if isinstance(ref, dict):
        return (f"{ref[width]:.2f}", ref[width], None) if width in ref else ("-", None, None)
    lo, hi = ref
    if width == WIDTHS[0]:
        return f"{lo:.1f} (span low)", lo, None
    if width == WIDTHS[-1]:
        return f"{hi:.1f} (span high)", hi, None
    return f"{lo:.1f}-{hi:.1f}", None, (lo, hi)


def difference(measured: float, point: float | None, span: tuple[float, float] | None) -> float | None:
    """Points above (+) or below (-) the paper's value; for a span, the distance outside it (0 inside)."""
    if point is not None:
        return measured - point
    if span is not None:
        lo, hi = span
        return measured - lo if measured < lo else measured - hi if measured > hi else 0.0
    return None


def saving_views(steps: list[StepRecord]) -> dict[str, Any]:
    """Other averages of the per-step saving than summary.json's plain step mean, in %. A step mean
    weighs the many short steps of the drain (a few long requests left) as much as full-batch ones,
    so: weighted by step time; over the steps at capacity (requests queued for a seat or memory);
    and the step mean per tenth of the run's time, to show how the saving moves as the load does."""
    held = [s for s in steps if s.num_logical_blocks]
    if not held:
        return {"time_weighted_pct": None, "at_capacity_pct": None, "by_time_decile_pct": []}
    weights = [s.step_time_s for s in held]
    loaded = [s.kv_sharing_saving for s in held if s.num_waiting or s.num_swapped]
    start, end = held[0].time_s, held[-1].time_s
    deciles: list[list[float]] = [[] for _ in range(10)]
    for s in held:
        deciles[min(int(10 * (s.time_s - start) / (end - start or 1.0)), 9)].append(s.kv_sharing_saving)
    return {
        "time_weighted_pct": 100 * sum(w * s.kv_sharing_saving for w, s in zip(weights, held)) / sum(weights),
        "at_capacity_pct": 100 * statistics.fmean(loaded) if loaded else None,
        "by_time_decile_pct": [100 * statistics.fmean(d) if d else None for d in deciles],
    }


def sim_run(overrides: list[str]) -> tuple[dict[str, Any], dict[str, Any], float]:
    """One simulated serving run: its summary, `saving_views` and the host seconds it took."""
    start = time.perf_counter()
    summary, engine = run_quietly([*SIM_BASE, *overrides])
    return summary, saving_views(engine.metrics.steps), time.perf_counter() - start


def sampling_overrides(mode: str, width: int) -> list[str]:
    if mode == "beam":
        return ["workload.use_beam_search=true", f"workload.n={width}", "workload.temperature=0.0"]
    # temperature > 0: the samples diverge right after the prompt, as in the paper's parallel sampling
    return ["workload.use_beam_search=false", f"workload.n={width}", "workload.temperature=1.0"]


def run_sim(args: argparse.Namespace, extra: list[str]) -> list[dict[str, Any]]:
    loads = {"alpaca": args.alpaca, "sharegpt": args.sharegpt}
    columns = ["mode", "n / width", "saving %", "paper %", "diff (pts)", "time-wtd %", "at capacity %",
               "KV used mean / max %", "preempt (swap fallback)", "decode batch", "finished", "host s"]
    console = Console(width=200)
    rows = []
    for workload, (requests, rate) in loads.items():
        table = Table(title=f"KV memory saved by sharing: OPT-13B, simulated A100-40GB, {workload}-like lengths, "
                            f"{int(requests)} requests at {rate:g} req/s")
        for col in columns:
            table.add_column(col, justify="left" if col == "mode" else "right")
        for mode in MODES:
            for width in args.widths:
                summary, views, host_s = sim_run([
                    f"workload={workload}", f"workload.num_requests={int(requests)}", f"workload.arrival_rate={rate}",
                    *sampling_overrides(mode, width), *extra,
                ])
                saving = 100 * summary["kv_sharing_saving_mean"]
                paper, point, span = paper_value(workload, mode, width)
                diff = difference(saving, point, span)
                table.add_row(
                    mode, str(width), f"{saving:.2f}", paper, "-" if diff is None else f"{diff:+.2f}",
                    *("-" if views[k] is None else f"{views[k]:.2f}" for k in ("time_weighted_pct", "at_capacity_pct")),
                    f"{100 * summary['kv_usage_mean']:.0f} / {100 * summary['kv_usage_max']:.0f}",
                    f"{summary['num_preemptions']} ({summary['num_swap_fallbacks']})",
                    f"{summary['mean_decode_batch_size']:.1f}",
                    f"{summary['num_finished']}/{summary['num_requests']}", f"{host_s:.1f}",
                )
                rows.append({
                    "target": "sim", "workload": workload, "mode": mode, "width": width, "requests": int(requests),
                    "rate": rate, "saving_pct": saving, "paper_pct": point, "paper_span": span, "diff_pts": diff,
                    "host_s": host_s, **views, "summary": summary,
                })
        console.print(table)
    return rows


def run_cpu(args: argparse.Namespace, extra: list[str]) -> list[dict[str, Any]]:
    overrides = [f"allocator.num_blocks={args.num_blocks}", *extra]
    executor = build_executor(compose_config(["model=smollm2-135m", "logger=none", "progress=false", *overrides]))
    assert executor.tokenizer is not None
    prompts = [executor.tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.prompts)]
    params = SamplingParams(n=args.width, use_beam_search=True, temperature=0.0, max_tokens=args.max_tokens,
                            ignore_eos=True)

    def engine(share: bool) -> LLM:
        return LLM("smollm2-135m", allocator=args.allocator, executor=executor,
                   overrides=[f"allocator.share_blocks={str(share).lower()}", *overrides])

    # untimed: the first forward passes and block copies pay one-off costs (allocation, kernel setup)
    warmup = SamplingParams(n=args.width, use_beam_search=True, temperature=0.0, max_tokens=4, ignore_eos=True)
    for share in (True, False):
        engine(share).generate(prompts[:2], warmup, use_tqdm=False)
    runs: list[dict[str, Any]] = []
    reference: list[list[list[int]]] | None = None
    for repeat in range(args.repeats):
        # alternate which setting goes first, so a slow spell of the machine hits both alike
        for share in (True, False) if repeat % 2 == 0 else (False, True):
            llm = engine(share)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - start
            tokens = [[c.token_ids for c in out.outputs] for out in outputs]
            reference = reference if reference is not None else tokens
            summary = summarize(llm.config, llm.engine)
            runs.append({
                "target": "cpu", "repeat": repeat, "share_blocks": share, "wall_s": wall,
                "output_tokens": summary["output_tokens"], "tokens_per_s": summary["output_tokens"] / wall,
                "saving_pct": 100 * summary["kv_sharing_saving_mean"],
                "peak_blocks": max((s.num_allocated_blocks for s in llm.engine.metrics.steps), default=0),
                "num_blocks": summary["num_total_blocks"], "preemptions": summary["num_preemptions"],
                "same_as_first_run": tokens == reference,
            })
    by_share = {share: [r for r in runs if r["share_blocks"] is share] for share in (True, False)}
    # the ratio within each repeat: both settings ran back to back in the same process
    ratios = [on["tokens_per_s"] / off["tokens_per_s"] for on, off in zip(by_share[True], by_share[False])]
    table = Table(title=f"SmolLM2-135M on this CPU: beam search width {args.width}, {args.prompts} prompts, "
                        f"{args.max_tokens} tokens each, allocator={args.allocator}, median of {args.repeats} run(s)")
    for col in ["share_blocks", "output tok/s", "wall s", "saving %", "peak KV blocks", "preemptions",
                "outputs identical", "tok/s ratio on/off"]:
        table.add_column(col, justify="right")
    for share, group in by_share.items():
        table.add_row(
            str(share).lower(), f"{statistics.median(r['tokens_per_s'] for r in group):.1f}",
            f"{statistics.median(r['wall_s'] for r in group):.2f}",
            f"{statistics.median(r['saving_pct'] for r in group):.1f}",
            f"{max(r['peak_blocks'] for r in group)} / {group[0]['num_blocks']}",
            str(max(r["preemptions"] for r in group)),
            "yes" if all(r["same_as_first_run"] for r in runs) else "NO",
            f"{statistics.median(ratios):.2f} ({', '.join(f'{x:.2f}' for x in ratios)})" if share else "",
        )
    Console(width=160).print(table)
    return runs


def write_out(path: Path, rows: list[dict[str, Any]]) -> None:
    if path.suffix == ".csv":
        # flat columns only: a run's nested summary goes to JSON
        flat = [{k: v for k, v in row.items() if not isinstance(v, dict)} for row in rows]
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(flat[0]))
            writer.writeheader()
            writer.writerows(flat)
    else:
        path.write_text(json.dumps(rows, indent=1, default=str) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target", choices=["sim", "cpu"])
    parser.add_argument("--alpaca", type=float, nargs=2, default=[600, 30], metavar=("REQUESTS", "RATE"))
    parser.add_argument("--sharegpt", type=float, nargs=2, default=[150, 2], metavar=("REQUESTS", "RATE"))
    parser.add_argument("--widths", type=int, nargs="+", default=WIDTHS)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--allocator", default="naive")
    parser.add_argument("--num-blocks", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args, extra = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    rows = run_sim(args, extra) if args.target == "sim" else run_cpu(args, extra)
    if args.out is not None:
        write_out(args.out, rows)


if __name__ == "__main__":
    main()
