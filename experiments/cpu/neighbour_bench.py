"""How much of its quiet speed a CPU run keeps beside a neighbour that keeps a core busy (issue 30).

    python experiments/cpu/neighbour_bench.py [--models smollm2-135m tiny-random] [--rounds 3]
        [--neighbours spin matmul] [--settings old new one-thread] [--requests 12] [override ...]

Each measured run is `python run.py model=M workload.num_requests=12 workload.output_len_max=64
logger=none progress=false [override ...]` in a subprocess, as the OpenMP wait policy is read once,
when torch loads; its summary.json gives output tok/s. A neighbour is a subprocess started before
the run and killed after it:

- `spin`: a pure-Python `while True: pass`, one core busy;
- `matmul`: a torch matmul loop on 2 threads with libgomp's default spinning wait.

Settings (`paged.utils.threads`):

- `old`: the behaviour before issue 30: libgomp's spinning wait (GOMP_SPINCOUNT=300000, its
  default) and one thread per core (`model.num_threads=<cores>`);
- `new`: paged's default (since issue 47 a short spin, `GOMP_SPINCOUNT=500`; one thread per core);
- `passive`: waiting threads sleep at once (OMP_WAIT_POLICY=PASSIVE, the default from issue 30 to 47);
- `one-thread`: paged's default with `model.num_threads=1`, for reference;
- `short-spin`, `spin-3k`, `spin-1k`, `spin-500`, `spin-300`: a spin of GOMP_SPINCOUNT=10000, 3000,
  1000, 500, 300 pauses before sleeping (issue 47: how much of the quiet gain of spinning a bound
  keeps, and at what cost beside a neighbour).

Runs alternate: every round runs each model and setting quiet, then beside each neighbour. The
table shows medians, busy / quiet, and "others" (cores that processes other than the run and its
neighbour kept busy during the quiet runs, from /proc/stat: above ~0.1 the machine was not idle and
the numbers are disturbed). The target: beside `spin`, SmolLM2 with the new default keeps >= 50% of
its quiet output tok/s (issue 47; issue 30 asked 40%), and its quiet speed is not below the old one's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
# issue 30 asked >= 0.40 of the quiet speed beside a busy core; issue 47, trading some of it for a short spin, >= 0.50
TARGET_MODEL, TARGET_NEIGHBOUR, TARGET_RATIO = "smollm2-135m", "spin", 0.50
# The variables paged.utils.threads reads or sets: cleared from each run's environment, so a setting's own
# values (and nothing inherited from this shell) choose how its threads wait.
THREAD_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS")
NEIGHBOURS = {
    "spin": "while True: pass",
    "matmul": "import torch\ntorch.set_num_threads(2)\na = torch.randn(512, 512)\nwhile True: a @ a",
}
# The neighbour's head start, so it is at full speed when the run starts.
NEIGHBOUR_WARMUP_S = 1.0


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def settings() -> dict[str, tuple[dict[str, str], list[str]]]:
    """Setting name -> (environment it adds, overrides it adds)."""
    return {
        "old": ({"GOMP_SPINCOUNT": "300000"}, [f"model.num_threads={_cores()}"]),
        "new": ({}, []),
        "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
        "one-thread": ({}, ["model.num_threads=1"]),
        "short-spin": ({"GOMP_SPINCOUNT": "10000"}, []),
        # issue 47's bounded spins: which keeps >= 0.5 of quiet beside a neighbour, and how much quiet gain?
        "spin-3k": ({"GOMP_SPINCOUNT": "3000"}, []),
        "spin-1k": ({"GOMP_SPINCOUNT": "1000"}, []),
        "spin-500": ({"GOMP_SPINCOUNT": "500"}, []),
        "spin-300": ({"GOMP_SPINCOUNT": "300"}, []),
    }


def _clean_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    return {**env, **extra}


def _busy_cpu_s() -> float:
    """CPU-seconds the whole machine has spent busy (not idle or iowait) since boot."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Run:
    tok_s: float
    others: float  # cores kept busy by processes other than the run (its neighbour included)


@dataclass
class Cell:
    quiet: list[Run] = field(default_factory=list)
    busy: dict[str, list[Run]] = field(default_factory=dict)


def measure(model: str, env: dict[str, str], overrides: list[str], neighbour: str | None) -> Run:
    """One run.py job; with `neighbour`, beside that neighbour for its whole length."""
    proc = None
    if neighbour is not None:
        proc = subprocess.Popen([sys.executable, "-c", NEIGHBOURS[neighbour]], env=_clean_env({}))
        time.sleep(NEIGHBOUR_WARMUP_S)
    try:
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, str(ROOT / "run.py"), f"model={model}", *overrides, "logger=none",
                   "progress=false", f"hydra.run.dir={out}"]
            busy0, own0, start = _busy_cpu_s(), _children_cpu_s(), time.perf_counter()
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - start
            others_s = _busy_cpu_s() - busy0 - (_children_cpu_s() - own0)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
            summary = json.loads((Path(out) / "summary.json").read_text())
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
    return Run(float(summary["output_tokens_per_s"]), max(0.0, others_s / wall))


def _median(runs: list[Run]) -> float:
    return statistics.median(r.tok_s for r in runs)


def render(results: dict[tuple[str, str], Cell], neighbours: list[str], rounds: int) -> Table:
    table = Table(title=f"Output tok/s beside a neighbour, median of {rounds} alternating rounds, "
                        f"{_cores()} cores")
    for column in ("model", "setting", "quiet", *[f"beside {n}" for n in neighbours],
                   *[f"{n} / quiet" for n in neighbours], "others (quiet)"):
        text = column in ("model", "setting")
        table.add_column(column, justify="left" if text else "right", no_wrap=text)
    for (model, setting), cell in results.items():
        quiet = _median(cell.quiet)
        busy = [_median(cell.busy[n]) for n in neighbours]
        others = statistics.median(r.others for r in cell.quiet)
        table.add_row(model, setting, f"{quiet:.1f}", *[f"{b:.1f}" for b in busy],
                      *[f"{b / quiet:.2f}" for b in busy], f"{others:.2f}")
    return table


def verdict(results: dict[tuple[str, str], Cell]) -> str:
    new, old = results.get((TARGET_MODEL, "new")), results.get((TARGET_MODEL, "old"))
    if new is None or TARGET_NEIGHBOUR not in new.busy:
        return f"target not measured: it needs model {TARGET_MODEL}, setting new and neighbour {TARGET_NEIGHBOUR}"
    ratio = _median(new.busy[TARGET_NEIGHBOUR]) / _median(new.quiet)
    line = (f"target (issues 30, 47): {TARGET_MODEL}, new default, beside {TARGET_NEIGHBOUR}: {ratio:.2f} of quiet "
            f"(>= {TARGET_RATIO:.2f}): {'met' if ratio >= TARGET_RATIO else 'NOT met'}")
    if old is not None:
        quiet = _median(new.quiet) / _median(old.quiet)
        line += f"; quiet speed new / old: {quiet:.2f} ({'not lower' if quiet >= 0.97 else 'LOWER'}, 3% noise allowed)"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "tiny-random"])
    parser.add_argument("--settings", nargs="+", default=["old", "new"], choices=list(settings()))
    parser.add_argument("--neighbours", nargs="+", default=["spin"], choices=list(NEIGHBOURS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--output-len-max", type=int, default=64)
    args, extra = parser.parse_known_args()
    workload = [f"workload.num_requests={args.requests}", f"workload.output_len_max={args.output_len_max}", *extra]
    chosen = {name: s for name, s in settings().items() if name in args.settings}
    results = {(m, s): Cell(busy={n: [] for n in args.neighbours}) for m in args.models for s in chosen}
    console = Console()
    for round_ in range(args.rounds):
        for model in args.models:
            for name, (env, overrides) in chosen.items():
                cell = results[(model, name)]
                for neighbour in [None, *args.neighbours]:
                    run = measure(model, _clean_env(env), [*overrides, *workload], neighbour)
                    (cell.quiet if neighbour is None else cell.busy[neighbour]).append(run)
                    console.log(f"round {round_ + 1}: {model} {name} {neighbour or 'quiet'}: {run.tok_s:.1f} tok/s "
                                f"(others {run.others:.2f} cores)")
    console.print(render(results, args.neighbours, args.rounds))
    console.print(verdict(results))


if __name__ == "__main__":
    main()
