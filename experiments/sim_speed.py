"""The simulator's speed at its two bars (issue 45): host seconds and peak memory of

- `single`: the single-engine 1-h trace (7,200 ShareGPT-like requests at 2 req/s, OPT-13B on one
  A100-40GB: `experiments/sim/sim_speed.py`'s run, issue 9's bar), and
- `fleet`: the 16-replica hour (`+experiment=routing router=prefix-aware workload.num_requests=115200`:
  16 x Llama-3-8B on H100, 32 req/s),

each in a child process of its own, so that its user+sys seconds and peak RSS are its alone
(`os.wait4`'s resource usage). Wall seconds are printed too; on a shared machine user+sys is the
steadier number.

    python experiments/sim_speed.py [--runs single,fleet] [--requests-scale 0.25] [--replicas 16]
                                    [--tree DIR] [--out DIR] [--json FILE] [override ...]

`--requests-scale` (or `--requests N`, both runs) scales the workloads down; `--replicas` sizes the
fleet (its arrival rate scales with it, 2 req/s per replica, so each replica sees the same load).
`--tree DIR` runs another checkout's `paged` (an old tree, for a before/after comparison).
`--out DIR` keeps each run's summary.json and requests.jsonl under DIR/<run> (to compare trees or
`executor.fast_forward` on and off byte for byte). Extra `key=value` overrides go to both runs.
`--profile FILE` writes the child's cProfile stats to FILE (`python -m pstats FILE`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SINGLE = ["executor=sim", "model=opt-13b", "hardware=a100-40g", "workload=sharegpt", "workload.arrival_rate=2"]
FLEET = ["+experiment=routing", "router=prefix-aware"]
RUNS = {"single": (SINGLE, 7200), "fleet": (FLEET, 115200)}
FLEET_REPLICAS = 16
# host-time keys: the only ones of summary.json that differ between two runs of one config
HOST_KEYS = ("host_time_s", "load_time_s", "sim_seconds_per_host_second")


def overrides_for(run: str, num_requests: int, replicas: int, extra: list[str]) -> list[str]:
    base, _ = RUNS[run]
    out = [*base, "logger=none", "progress=false", f"workload.num_requests={num_requests}"]
    if run == "fleet" and replicas != FLEET_REPLICAS:
        out += [f"cluster.num_replicas={replicas}", f"workload.arrival_rate={2 * replicas}"]
    return out + extra


def child(overrides: list[str], out: Path, profile: str | None) -> None:
    """Run one experiment in this process and write its outputs into `out`."""
    import logging

    from omegaconf import OmegaConf

    from paged.config import compose_config
    from paged.experiment.run import run_experiment

    logging.basicConfig(level=logging.WARNING)
    cfg = compose_config(overrides)
    OmegaConf.set_struct(cfg, False)
    out.mkdir(parents=True, exist_ok=True)
    if profile is None:
        run_experiment(cfg, out)
        return
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    run_experiment(cfg, out)
    profiler.disable()
    profiler.dump_stats(profile)


def measure(run: str, overrides: list[str], tree: Path, out: Path, profile: str | None) -> dict:
    """Run `overrides` in a child process on `tree`'s `paged`; its host seconds and peak RSS."""
    env = {**os.environ, "PYTHONPATH": str(tree), "WANDB_MODE": "disabled"}
    profiling = ["--profile", profile] if profile else []
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(out), *profiling, "--", *overrides]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=tree, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if status:
        raise SystemExit(f"{run}: the child exited with status {status}: {' '.join(cmd)}")
    summary = json.loads((out / "summary.json").read_text())
    return {
        "run": run,
        "overrides": overrides,
        "tree": str(tree),
        "user_sys_s": round(usage.ru_utime + usage.ru_stime, 2),
        "wall_s": round(wall, 2),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),  # Linux: kilobytes
        "run_host_time_s": summary["host_time_s"],
        "num_requests": summary["num_requests"],
        "num_engine_steps": summary["num_engine_steps"],
        "sim_time_s": summary.get("sim_time_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--runs", default="single,fleet", help="comma-separated: single, fleet")
    parser.add_argument("--requests-scale", type=float, default=1.0)
    parser.add_argument("--requests", type=int, help="requests of every run (instead of a scale)")
    parser.add_argument("--replicas", type=int, default=FLEET_REPLICAS)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile")
    args, extra = parser.parse_known_args()
    extra = [e for e in extra if e != "--"]
    if args.child is not None:
        child(extra, args.child, args.profile)
        return
    runs = args.runs.split(",")
    for run in runs:
        if run not in RUNS:
            raise SystemExit(f"--runs: {run!r} is not a run; allowed: {', '.join(RUNS)}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            _, full = RUNS[run]
            n = args.requests or max(1, round(full * args.requests_scale * (args.replicas / FLEET_REPLICAS
                                                                             if run == "fleet" else 1)))
            out = (args.out or Path(tmp)) / run
            result = measure(run, overrides_for(run, n, args.replicas, extra), args.tree.resolve(), out, args.profile)
            results.append(result)
            print(f"{run:6s} {n:7d} requests  {result['num_engine_steps']:9d} steps  run host "
                  f"{result['run_host_time_s']:8.2f} s  user+sys {result['user_sys_s']:8.2f} s  wall "
                  f"{result['wall_s']:8.2f} s  peak RSS {result['peak_rss_mib']:8.1f} MiB  ({result['tree']})",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
