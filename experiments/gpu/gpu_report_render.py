"""The markdown report of experiments/gpu/gpu_report.py, made of the records its steps leave
(gpu_report_records.py): a pure function of them, so tests/test_gpu_report.py renders fabricated
ones without a GPU.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report_records import (  # noqa: E402  (sibling script, not a package)
    BenchResult,
    CommandRun,
    Environment,
    JobResult,
    Section,
    Skipped,
    TestsResult,
)

TAIL_LINES = 40
# pytest's summary-line words, in its own order
COUNT_ORDER = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warning", "error")


# -- the report ------------------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *(line(r) for r in rows)]


def _fenced(text: str) -> list[str]:
    return ["```", text.rstrip("\n"), "```"]


def _tail(text: str) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-TAIL_LINES:])


def _shown_command(command: Sequence[str]) -> str:
    # the interpreter's path says nothing about the run; `python` reads as the reader would type it
    return " ".join(["python", *command[1:]] if command and command[0] == sys.executable else command)


def _status(run: CommandRun) -> str:
    if run.returncode is None:
        return f"killed at its timeout, {run.timeout_s:.0f} s"
    return f"exit {run.returncode}, {run.wall_s:.1f} s (timeout {run.timeout_s:.0f} s)"


def _command_line(run: CommandRun) -> str:
    return f"`{_shown_command(run.command)}`: {_status(run)}"


def _counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{counts[k]} {k}" for k in COUNT_ORDER if k in counts) or "no pytest summary"


def ttft_ratio(job: JobResult) -> tuple[float, float, float] | None:
    """(ratio, slower run's TTFT mean, faster run's) where both runs wrote one; else None."""
    if job.ttft is None:
        return None
    means = {r.label: (r.summary or {}).get("ttft_mean_s") for r in job.runs}
    slower, faster = means.get(job.ttft.slower), means.get(job.ttft.faster)
    if not isinstance(slower, int | float) or not isinstance(faster, int | float) or not faster:
        return None
    return slower / faster, slower, faster


def _outcome(section: Section) -> str:
    """The one cell of the overview table that says how a step went."""
    if isinstance(section, Skipped):
        return f"skipped: {section.reason}"
    if isinstance(section, TestsResult):
        return _counts_text(section.counts) + ("" if section.run.returncode is not None else " (timed out)")
    if isinstance(section, BenchResult):
        return "; ".join(f"{r.label} {'ok' if r.run.ok else _status(r.run)}" for r in section.runs) or "nothing ran"
    ran = [r for r in section.runs if r.summary is not None]
    throughput = " / ".join(f"{r.label} {r.summary['output_tokens_per_s']:.1f} tok/s" for r in ran)
    agreement = "".join(f"; {a} vs {b}: {o.identical}/{o.requests} requests identical" for a, b, o in section.outputs)
    ratio = ttft_ratio(section)
    ttft = f"; TTFT {section.ttft.slower} / {section.ttft.faster}: {ratio[0]:.2f}x" if ratio and section.ttft else ""
    error = sim_error(section)
    sim = f"; {section.sim.real} vs the simulator: {error:+.1%} tok/s" if error is not None and section.sim else ""
    return (throughput or "no run finished") + agreement + ttft + sim


def render_environment(env: Environment) -> list[str]:
    major, minor = env.capability
    rows = [
        ("GPU", env.gpu),
        ("memory", f"{env.memory_gib:.1f} GiB"),
        ("compute capability", f"{major}.{minor} (sm_{major}{minor}), {env.multiprocessors} SMs"),
        ("driver", env.driver),
        ("torch", f"{env.torch} (CUDA {env.cuda})"),
        ("NVRTC", env.nvrtc),
        *env.packages.items(),
        ("Python", env.python),
        ("commit", f"{env.commit}{' (with uncommitted changes)' if env.dirty else ''}"),
        ("date", env.date.isoformat(timespec="minutes")),
    ]
    return ["## Environment", "", *_table(("", ""), rows)]


def render_tests(tests: TestsResult) -> list[str]:
    lines = [_command_line(tests.run), ""]
    if tests.counts:
        shown = [k for k in COUNT_ORDER if k in tests.counts]
        lines += [*_table(shown, [[tests.counts[k] for k in shown]]), ""]
    if tests.skips:
        lines += ["Skipped:", "", *_fenced("\n".join(tests.skips)), ""]
    if tests.problems:
        lines += ["Failed:", "", *_fenced("\n".join(tests.problems)), ""]
    if not tests.run.ok:
        lines += ["Output's tail:", "", *_fenced(_tail(tests.run.stdout + tests.run.stderr)), ""]
    return lines


def render_bench(bench: BenchResult) -> list[str]:
    """Each benchmark's output verbatim under its own heading, and stderr's tail where it failed."""
    lines = []
    for r in bench.runs:
        lines += [f"### {r.label[:1].upper()}{r.label[1:]}", "", _command_line(r.run), ""]
        if r.run.stdout.strip():
            lines += [*_fenced(r.run.stdout), ""]
        if not r.run.ok:
            lines += ["stderr's tail:", "", *_fenced(_tail(r.run.stderr)), ""]
    return lines


# (label, summary.json key, scale, format); paged/engine/metrics.py and paged/experiment/summary.py define the keys
JOB_METRICS = [
    ("output tokens/s", "output_tokens_per_s", 1, "{:.1f}"),
    ("TPOT mean (ms)", "tpot_mean_s", 1000, "{:.2f}"),
    ("TPOT p99 (ms)", "tpot_p99_s", 1000, "{:.2f}"),
    ("ITL mean (ms)", "itl_mean_s", 1000, "{:.2f}"),
    ("ITL p99 (ms)", "itl_p99_s", 1000, "{:.2f}"),
    ("TTFT mean (s)", "ttft_mean_s", 1, "{:.3f}"),
    ("TTFT p99 (s)", "ttft_p99_s", 1, "{:.3f}"),
    ("total time, first arrival to last finish (s)", "wall_time_s", 1, "{:.2f}"),
    ("host time of the run (s)", "host_time_s", 1, "{:.2f}"),
    ("load time, engine build (s)", "load_time_s", 1, "{:.2f}"),
    ("requests finished", "num_finished", 1, "{}"),
    ("engine steps", "num_engine_steps", 1, "{}"),
    ("CUDA-graph steps", "cuda_graph_steps", 1, "{}"),
    ("eager decode steps", "eager_decode_steps", 1, "{}"),
    ("eager mixed steps", "eager_mixed_steps", 1, "{}"),
]


def _metric_cells(
    key: str, scale: float, fmt: str, summaries: Sequence[dict[str, Any] | None], ratio: tuple[int, int]
) -> list[str]:
    """One value per run ("-" where absent: a failed run, or a key older trees do not write), then the
    ratio of the runs at indices `ratio` (numerator, denominator)."""
    values = [s.get(key) if s is not None else None for s in summaries]
    cells = ["-" if v is None else fmt.format(v * scale) for v in values]
    top, bottom = values[ratio[0]], values[ratio[1]]
    numbers = all(isinstance(v, int | float) for v in (top, bottom))
    return [*cells, f"{top / bottom:.2f}" if numbers and bottom else "-"]


def _ratio_runs(job: JobResult) -> tuple[int, int]:
    """Indices of the ratio column's runs: `job.ratio`'s where both ran, else the last over the first."""
    labels = [r.label for r in job.runs]
    if job.ratio is not None and all(label in labels for label in job.ratio):
        return labels.index(job.ratio[0]), labels.index(job.ratio[1])
    return len(labels) - 1, 0


SIM_METRICS = (("output tok/s", "output_tokens_per_s", 1, "{:.0f}"), ("TPOT mean", "tpot_mean_s", 1000, "{:.2f} ms"),
               ("TTFT mean", "ttft_mean_s", 1, "{:.3f} s"))


def sim_error(job: JobResult) -> float | None:
    """(real - simulated) / simulated output tok/s where both runs wrote one; else None."""
    if job.sim is None:
        return None
    summaries = {r.label: r.summary or {} for r in job.runs}
    real = summaries.get(job.sim.real, {}).get("output_tokens_per_s")
    simulated = summaries.get(job.sim.simulated, {}).get("output_tokens_per_s")
    if not isinstance(real, int | float) or not isinstance(simulated, int | float) or not simulated:
        return None
    return (real - simulated) / simulated


def render_sim(job: JobResult) -> list[str]:
    """The real run against the simulator's as a sentence: each metric side by side with its error."""
    if job.sim is None:
        return []
    c, error = job.sim, sim_error(job)
    if error is None:
        return [f"{c.real} against the simulator's {c.simulated}: not measured (a run is missing or wrote no "
                "throughput).", ""]
    summaries = {r.label: r.summary or {} for r in job.runs}
    parts = []
    for name, key, scale, fmt in SIM_METRICS:
        real, simulated = summaries[c.real].get(key), summaries[c.simulated].get(key)
        if isinstance(real, int | float) and isinstance(simulated, int | float) and simulated:
            parts.append(f"{name} {fmt.format(real * scale)} vs {fmt.format(simulated * scale)} "
                         f"({(real - simulated) / simulated:+.1%})")
    verdict = "within" if abs(error) <= c.target else "not within"
    return [f"{c.real} against the simulator's {c.simulated} (same model shape and workload): {'; '.join(parts)}; "
            f"output tok/s **{verdict} {c.target:.0%}** of the simulator's (the simulator prices GPU work only: "
            "the gap is the engine's host cost).", ""]


def render_ttft(job: JobResult) -> list[str]:
    """The TTFT ratio as a sentence: the torch kernels' TTFT over ours on the same prompts."""
    if job.ttft is None:
        return []
    t, ratio = job.ttft, ttft_ratio(job)
    if ratio is None:
        return [f"TTFT mean of {t.slower} over {t.faster}: not measured (a run wrote no TTFT).", ""]
    value, slower, faster = ratio
    verdict = "met" if value >= t.target else "NOT met"
    return [f"TTFT mean of {t.slower} over {t.faster} (the same prompts): **{value:.2f}x** ({slower:.3f} s / "
            f"{faster:.3f} s); the target, at least {t.target:g}x lower with our kernels: {verdict}.", ""]


def render_job(job: JobResult) -> list[str]:
    lines = []
    for r in job.runs:
        lines += [f"- {r.label}: {_command_line(r.run)}"]
    lines.append("")
    summaries = [r.summary for r in job.runs]
    if any(s is not None for s in summaries):
        top, bottom = _ratio_runs(job)
        ratio = f"{job.runs[top].label} / {job.runs[bottom].label}"
        rows = [[label, *_metric_cells(key, scale, fmt, summaries, (top, bottom))]
                for label, key, scale, fmt in JOB_METRICS]
        rows += [[label, *("-" if s is None else s.get(key, "-") for s in summaries), ""]
                 for label, key in (("attention", "attention_kernel"), ("executor", "executor_description"))]
        lines += [*_table(["metric", *(r.label for r in job.runs), ratio], rows), ""]
    lines += render_ttft(job)
    lines += render_sim(job)
    for first, second, o in job.outputs:
        where = "" if o.first_difference is None else f"; the first difference: {o.first_difference}"
        lines += [f"Outputs of {first} and {second}: **{o.identical} of {o.requests} requests** have identical "
                  f"output token ids ({o.matching_tokens} of {o.tokens} tokens agree up to each request's first "
                  f"difference){where}.", ""]
    for r in job.runs:
        if not r.run.ok:
            lines += [f"{r.label}, stderr's tail:", "", *_fenced(_tail(r.run.stderr)), ""]
    return lines


def render_section(title: str, section: Section) -> list[str]:
    if isinstance(section, Skipped):
        body = [f"Skipped: {section.reason}.", ""]
    elif isinstance(section, TestsResult):
        body = render_tests(section)
    elif isinstance(section, BenchResult):
        body = render_bench(section)
    else:
        body = render_job(section)
    wall = "" if isinstance(section, Skipped) else f" ({section.wall_s:.0f} s)"
    return [f"## {title}{wall}", "", *body]


TITLES = ("1. CUDA tests", "2. Kernel benchmarks: decode, prefill; host overhead",
          "3. The default job: CUDA graphs off / on, CUDA / CPU, our kernels / torch's; under load; Llama-3-8B's "
          "shape against the simulator")


def render_report(env: Environment, tests: Section, bench: Section, job: Section, budget_min: float) -> str:
    """The whole report: the device, an overview, the environment, then one section per step."""
    sections = (tests, bench, job)
    used = sum(0.0 if isinstance(s, Skipped) else s.wall_s for s in sections)
    overview = [(title, _outcome(s), "-" if isinstance(s, Skipped) else f"{s.wall_s:.0f} s")
                for title, s in zip(TITLES, sections)]
    lines = [
        f"# GPU report: {env.gpu}",
        "",
        f"{env.date:%Y-%m-%d}, commit {env.commit}{' (dirty)' if env.dirty else ''}: "
        f"`python experiments/gpu/gpu_report.py` (`make gpu-report`), {used / 60:.1f} of {budget_min:g} minutes.",
        "",
        *_table(("section", "outcome", "wall time"), overview),
        "",
        *render_environment(env),
        "",
    ]
    for title, section in zip(TITLES, sections):
        lines += render_section(title, section)
    return "\n".join(lines).rstrip("\n") + "\n"


def report_name(env: Environment) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", env.gpu.lower()).strip("-")
    return f"{env.date:%Y-%m-%d}-{slug}.md"

