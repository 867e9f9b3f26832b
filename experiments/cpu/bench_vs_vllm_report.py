"""What experiments/cpu/bench_vs_vllm.py measures, and the table, greedy agreement and JSON made of it.

The runner fills these records; everything here is a pure function of them, so
tests/test_bench_vs_vllm.py checks the agreement counts and renders the table from fabricated rows.

Agreement (round 1 of every row, N requests, each compared over its requested output length):
- "= vLLM": requests whose output tokens all equal the vLLM reference row's (the first vLLM row
  that ran; vLLM runs in the benchmark's dtype). "32 = vLLM": whose first 32 output tokens do
  (all of them for outputs shorter than 32).
- "= fp32", "32 = fp32": the same against paged's fp32 outputs of the same requests (present when
  the benchmark runs an fp32 reference, the default in bf16; see bench_vs_vllm.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from bench_vs_vllm_roofline import SHORT_DTYPE, MatmulPeak
from rich.console import Console
from rich.markup import escape
from rich.table import Table

FIRST_TOKENS = 32  # the "first 32 tokens of each request"


@dataclass
class RoundResult:
    elapsed_s: float
    useful_tokens: int
    ttft_mean_s: float | None
    tpot_mean_s: float | None
    outputs: list[list[int]]

    @property
    def tok_s(self) -> float:
        return self.useful_tokens / self.elapsed_s


@dataclass
class SystemResult:
    """One row: a system in one configuration and dtype, its load time and its rounds (or why it failed)."""

    name: str
    kind: str  # paged | hf | vllm
    dtype: str
    load_s: float | None = None
    rounds: list[RoundResult] = field(default_factory=list)
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def median(self, key: Callable[[RoundResult], float | None]) -> float | None:
        values = [v for r in self.rounds if (v := key(r)) is not None]
        return statistics.median(values) if values else None

    @property
    def ran(self) -> bool:
        return self.error is None and bool(self.rounds)


@dataclass
class Reference:
    """Outputs the rows are compared with, and where they came from (the row and round, or the extra pass)."""

    name: str
    outputs: list[list[int]]


def mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def agreeing(outputs: list[list[int]], reference: list[list[int]], lengths: list[int], first: int | None = None) -> int:
    """Requests whose first `first` output tokens (all requested ones if None) equal the reference's."""
    return sum(a[:k] == b[:k] for a, b, n in zip(outputs, reference, lengths) for k in [min(n, first or n)])


def agreement(results: list[SystemResult], lengths: list[int], vllm: Reference | None,
              fp32: Reference | None) -> dict[str, dict[str, int | None]]:
    """Per row that ran: its round-1 agreement with each reference (None where that reference is missing)."""
    table = {}
    for r in results:
        if not r.rounds:
            continue
        row: dict[str, int | None] = {}
        for label, ref in (("vllm", vllm), ("fp32", fp32)):
            out = r.rounds[0].outputs
            row[f"full_vs_{label}"] = None if ref is None else agreeing(out, ref.outputs, lengths)
            row[f"first{FIRST_TOKENS}_vs_{label}"] = None if ref is None else agreeing(
                out, ref.outputs, lengths, FIRST_TOKENS)
        table[r.name] = row
    return table


def best(results: list[SystemResult], kind: str, dtype: str) -> SystemResult | None:
    """The fastest row of a kind in a dtype (by median tok/s)."""
    ran = [r for r in results if r.kind == kind and r.dtype == dtype and r.ran]
    return max(ran, key=lambda r: r.median(lambda x: x.tok_s) or 0.0, default=None)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.1f}"


def _count(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def print_table(console: Console, results: list[SystemResult], roofline_tok_s: float, peak: MatmulPeak,
                num_requests: int, agree: dict[str, dict[str, int | None]], with_fp32: bool, notes: list[str]) -> None:
    """The rows, then each failure on its own line, then the notes."""
    short = SHORT_DTYPE.get(peak.dtype, peak.dtype)
    table = Table(title=f"SmolLM2-135M {peak.dtype}, {num_requests} requests, greedy, ignore_eos ({short} matmul "
                        f"peak {peak.peak:.0f} GFLOP/s, roofline {roofline_tok_s:.0f} tok/s; agreement: requests "
                        f"of {num_requests})")
    keys = ["full_vs_vllm", f"first{FIRST_TOKENS}_vs_vllm"]
    columns = ["system", "load/start (s)", "serve (s)", "tok/s", "tok/s per round", "TTFT mean (ms)",
               "TPOT mean (ms)", f"% of the {short} roofline", "= vLLM", f"{FIRST_TOKENS} = vLLM"]
    if with_fp32:
        keys += ["full_vs_fp32", f"first{FIRST_TOKENS}_vs_fp32"]
        columns += ["= fp32", f"{FIRST_TOKENS} = fp32"]
    for col in columns:
        table.add_column(col, justify="left" if col == "system" else "right")
    for r in results:
        if not r.ran:
            table.add_row(escape(r.name), *["-"] * 7, *["n/a"] * len(keys))
            continue
        tok_s = r.median(lambda x: x.tok_s)
        table.add_row(
            escape(r.name), "n/a" if r.load_s is None else f"{r.load_s:.1f}", f"{r.median(lambda x: x.elapsed_s):.1f}",
            f"{tok_s:.1f}", " / ".join(f"{x.tok_s:.1f}" for x in r.rounds),
            _ms(r.median(lambda x: x.ttft_mean_s)), _ms(r.median(lambda x: x.tpot_mean_s)),
            f"{100 * tok_s / roofline_tok_s:.1f}", *(_count(agree[r.name][k]) for k in keys),
        )
    console.print(table)
    # names, errors and notes are text: a "[...]" in them (a vLLM log line) is not rich markup
    for r in results:
        if r.error is not None:
            console.print(f"[red]{escape(r.name)} failed:[/red] {escape(r.error)}")
    for note in notes:
        console.print(escape(note))


def speed_notes(results: list[SystemResult], dtype: str, fp32: Reference | None,
                fp32_pass: RoundResult | None) -> list[str]:
    """paged's best row in the run's dtype against vLLM's and HF's best, and against paged fp32 in a bf16 run."""
    paged_best = best(results, "paged", dtype)
    if paged_best is None:
        return []
    pb = paged_best.median(lambda x: x.tok_s)
    notes = []
    for label, other in (("vLLM best", best(results, "vllm", dtype)), ("HF best", best(results, "hf", dtype))):
        if other is not None:
            notes.append(f"paged best ({paged_best.name}) / {label} ({other.name}) = "
                         f"{pb / other.median(lambda x: x.tok_s):.2f}x")
    if dtype != "float32" and (fp32_row := best(results, "paged", "float32")) is not None:
        notes.append(f"paged best ({paged_best.name}) / paged fp32 ({fp32_row.name}, alternated rounds) = "
                     f"{pb / fp32_row.median(lambda x: x.tok_s):.2f}x")
    elif fp32 is not None and fp32_pass is not None:
        notes.append(f"fp32 reference ({fp32.name}): {fp32_pass.tok_s:.1f} tok/s in {fp32_pass.elapsed_s:.1f} s; "
                     f"paged best / it = {pb / fp32_pass.tok_s:.2f}x (indicative: not alternated; add an fp32 "
                     "--paged-config row for a timed ratio)")
    return notes


def reference_notes(vllm: Reference | None, fp32: Reference | None, with_fp32: bool) -> list[str]:
    notes = ["Agreement vs vLLM: n/a (no vLLM row ran)." if vllm is None else
             f"Agreement reference (vLLM): {vllm.name}."]
    if with_fp32:
        notes.append(f"Agreement reference (fp32): {fp32.name}." if fp32 is not None else
                     "Agreement vs fp32: n/a (the fp32 reference did not run).")
    return notes


def json_report(results: list[SystemResult], peak: MatmulPeak, roofline_tok_s: float,
                agree: dict[str, dict[str, int | None]], vllm: Reference | None, fp32: Reference | None,
                fp32_pass: RoundResult | None) -> dict[str, Any]:
    """Every measurement, per round, without the output tokens."""
    def rounds(r: SystemResult) -> list[dict[str, Any]]:
        return [{k: v for k, v in asdict(x).items() if k != "outputs"} | {"tok_s": x.tok_s} for x in r.rounds]

    return {
        "dtype": peak.dtype, "matmul_gflops": peak.gflops, "onednn_skipped": peak.onednn_skipped,
        "packed_skipped": peak.packed_skipped,
        "peak_gflops": peak.peak, "peak_kernel": peak.best, "roofline_tok_s": roofline_tok_s,
        "agreement": agree, "agreement_first_tokens": FIRST_TOKENS,
        "agreement_references": {"vllm": vllm and vllm.name, "fp32": fp32 and fp32.name},
        "fp32_reference_pass": None if fp32_pass is None else
        {k: v for k, v in asdict(fp32_pass).items() if k != "outputs"} | {"tok_s": fp32_pass.tok_s},
        "systems": [{
            "name": r.name, "kind": r.kind, "dtype": r.dtype, "load_s": r.load_s, "error": r.error, "info": r.info,
            "median_tok_s": r.median(lambda x: x.tok_s), "rounds": rounds(r),
        } for r in results],
    }
