"""How far `executor=sim` is from measurements it was not fitted to; prints one table per check.

    python experiments/sim/sim_validation.py cpu [--requests 64] [--repeats 1] [override ...]
    python experiments/sim/sim_validation.py gpu

`cpu`: the real executor (SmolLM2-135M on this CPU) and `executor=sim hardware=cpu-local` run the
same requests with the same config; total time, mean TTFT and mean TPOT are compared. The sim's
numbers come from `paged/sim/calibrate.py`'s microbenchmarks and its probe of the real engine (run
first if not cached; `python experiments/sim/calibrate.py` re-measures), never from this workload. With
`--repeats`, real runs alternate with sim runs and medians are compared.

`gpu`: Llama-2-7B (fp16, one GPU) on `a100-80g` / `h100-sxm` against published step times; each
row simulates the published setup (prompt length, output length, batch, all arriving at once).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from paged.config import compose_config
from paged.experiment.run import run_experiment, run_quietly

KEYS = (("wall_time_s", "total time (s)"), ("ttft_mean_s", "mean TTFT (s)"), ("tpot_mean_s", "mean TPOT (s)"))

# (GPU, what, published value in seconds, prompt, output, batch, summary key, source)
PUBLISHED = [
    ("a100-80g", "prefill 128 tokens, bs 1 (TTFT)", 0.016, 128, 1, 1, "ttft_mean_s",
     "TensorRT-LLM v0.5 docs/source/performance.md, A100 SXM 80GB FP16"),
    ("a100-80g", "prefill 2048 tokens, bs 1 (TTFT)", 0.133, 2048, 1, 1, "ttft_mean_s",
     "TensorRT-LLM v0.5 docs/source/performance.md, A100 SXM 80GB FP16"),
    ("a100-80g", "prefill 2048 tokens, bs 1 (TTFT)", 0.139, 2048, 128, 1, "ttft_mean_s",
     "LMDeploy v0.1.0a1 docs/en/benchmark/a100_fp16.md, A100-80G"),
    ("a100-80g", "decode, bs 1 (TPOT)", 1 / 107.38, 8, 200, 1, "tpot_mean_s",
     "torchao benchmark_results.txt, 107.38 tok/s, A100 80GB SXM4 bf16"),
    ("a100-80g", "decode 128/128, bs 1 (TPOT)", 1 / 102.21, 128, 128, 1, "tpot_mean_s",
     "LMDeploy a100_fp16.md, 102.21 tok/s"),
    ("a100-80g", "decode 128/2048, bs 16 (per-token P50)", 0.015, 128, 2048, 16, "tpot_mean_s",
     "LMDeploy a100_fp16.md"),
    ("a100-80g", "decode 128/2048, bs 32 (per-token P50)", 0.021, 128, 2048, 32, "tpot_mean_s",
     "LMDeploy a100_fp16.md"),
    ("a100-80g", "decode 128/2048, bs 64 (per-token P50)", 0.030, 128, 2048, 64, "tpot_mean_s",
     "LMDeploy a100_fp16.md"),
    ("a100-80g", "128 in / 20 out, bs 1 (e2e)", 0.2340, 128, 20, 1, "e2e_latency_mean_s",
     "NVIDIA NeMo performance/llama.html, A100 80GB SXM4"),
    ("a100-80g", "128 in / 20 out, bs 8 (e2e)", 0.3295, 128, 20, 8, "e2e_latency_mean_s",
     "NVIDIA NeMo performance/llama.html, A100 80GB SXM4"),
    ("h100-sxm", "128 in / 20 out, bs 1 (e2e)", 0.1538, 128, 20, 1, "e2e_latency_mean_s",
     "NVIDIA NeMo performance/llama.html, H100 80GB HBM3"),
    ("h100-sxm", "128 in / 20 out, bs 8 (e2e)", 0.1992, 128, 20, 8, "e2e_latency_mean_s",
     "NVIDIA NeMo performance/llama.html, H100 80GB HBM3"),
]


def simulate(overrides: list[str]) -> dict[str, Any]:
    """Run the sim in process (no output files) and return its summary metrics."""
    return run_quietly(["executor=sim", *overrides])[0]


def _error(sim: float, ref: float) -> str:
    return f"{(sim - ref) / ref:+.1%}"


def validate_cpu(requests: int, repeats: int, extra: list[str]) -> None:
    common = [f"workload.num_requests={requests}", "logger=none", "progress=false", "allocator.num_blocks=2048", *extra]
    runs: dict[str, list[dict[str, Any]]] = {"real": [], "sim": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for kind in ("real", "sim") if i % 2 == 0 else ("sim", "real"):
                overrides = common if kind == "real" else ["executor=sim", "hardware=cpu-local", *common]
                cfg = compose_config(overrides)
                runs[kind].append(run_experiment(cfg, Path(tmp) / f"{kind}-{i}"))
    table = Table(title=f"sim (cpu-local) vs real executor, SmolLM2-135M, {requests} requests, {repeats} run(s) each")
    for column in ("metric", "real", "sim", "error"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for key, label in KEYS:
        real = statistics.median(r[key] for r in runs["real"])
        sim = statistics.median(r[key] for r in runs["sim"])
        table.add_row(label, f"{real:.3f}", f"{sim:.3f}", _error(sim, real))
    host = statistics.median(r["host_time_s"] for r in runs["sim"])
    table.caption = f"sim host time {host:.2f} s per run"
    Console().print(table)


def validate_gpu() -> None:
    table = Table(title="sim vs published Llama-2-7B fp16 step times (TP=1)")
    for column in ("GPU", "setup", "published (ms)", "sim (ms)", "error", "source"):
        table.add_column(column, justify="right" if column in ("published (ms)", "sim (ms)", "error") else "left")
    for gpu, what, ref, prompt, output, batch, key, source in PUBLISHED:
        summary = simulate([
            "model=llama-2-7b", f"hardware={gpu}", "workload=fixed", f"workload.prompt_len={prompt}",
            f"workload.output_len={output}", f"workload.num_requests={batch}", "scheduler.max_model_len=4096",
            "scheduler.max_num_batched_tokens=4096",
        ])
        sim = summary[key]
        table.add_row(gpu, what, f"{ref * 1e3:.1f}", f"{sim * 1e3:.1f}", _error(sim, ref), source)
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=("cpu", "gpu"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    args, extra = parser.parse_known_args()
    logging.basicConfig(level=logging.WARNING)
    if args.check == "cpu":
        validate_cpu(args.requests, args.repeats, extra)
    else:
        validate_gpu()


if __name__ == "__main__":
    main()
