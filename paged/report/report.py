"""`python -m paged.report DIR`: a run or sweep folder into results.csv, a table, PNGs and table.md.

The sweep's preset may carry a `report` node (conf/experiment/*.yaml): the metrics the table shows,
the plots, the paper's numbers to compare with, and the sustainable-rate analysis."""

from __future__ import annotations

import csv
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from paged.report.collect import Collection, Job, ReportError, collect, reject_unknown
from paged.report.compare import PaperPoint, compare
from paged.report.plots import PlotSpec, plot
from paged.report.ratio import Ratio, ratios
from paged.report.sustainable import Sustainable, sustainable_rates
from paged.report.sweep import REPEAT_KEY, run_command
from paged.report.table import aggregate, is_number, job_rows
from paged.utils.atomic_file import OutputError, atomic_open, write_text

log = logging.getLogger(__name__)

# vLLM's benchmark names, and the paper's latency measure
DEFAULT_METRICS = (
    "request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "p99_e2el_ms",
    "normalized_latency_s_per_token", "num_preemptions",
)
COMPARE_COLUMNS = ["result", "ours", "paper", "difference", "tolerance", "verdict", "note"]
REPORT_KEYS = {"title", "metrics", "plots", "paper", "sustainable", "ratio", "out", "notes", "publish"}


@dataclass
class Report:
    out_dir: Path
    rows: list[dict[str, Any]]  # one per job (results.csv)
    aggregated: list[dict[str, Any]]  # one per configuration, repeats folded
    derived: list[dict[str, Any]]  # sustainable rates
    ratios: list[dict[str, Any]]  # a metric over a baseline's, per configuration
    comparisons: list[dict[str, Any]]  # against the paper
    failed: list[Job]
    images: list[Path] = field(default_factory=list)
    experiment: str | None = None


def _fmt(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value)


def _cell(row: dict[str, Any], column: str) -> str:
    """A value; over repeats, the median with its min-max spread."""
    text = _fmt(row.get(column))
    if row.get("n", 1) > 1 and is_number(row.get(f"{column}_min")):
        text += f" ({_fmt(row[f'{column}_min'])}–{_fmt(row[f'{column}_max'])})"
    return text


def _markdown(rows: list[dict[str, Any]], columns: list[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r, c).replace("|", "\\|") for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _rich(title: str, rows: list[dict[str, Any]], columns: list[str]) -> Table:
    table = Table(title=title, show_header=True)
    for c in columns:
        table.add_column(c, justify="right" if rows and is_number(rows[0].get(c)) else "left")
    for r in rows:
        table.add_row(*(_cell(r, c) for c in columns))
    return table


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with atomic_open(path, newline="") as f:
        writer = csv.DictWriter(f, columns, restval="")
        writer.writeheader()
        writer.writerows(rows)


def preset_report(experiment: str) -> dict[str, Any]:
    """The `report` node of `conf/experiment/<experiment>.yaml` as it is now (to re-report an old
    sweep with a changed table, plots or paper numbers, without re-running it)."""
    from omegaconf import OmegaConf

    from paged.utils.assets import asset_dir

    folder = asset_dir("conf") / "experiment"
    path = folder / f"{experiment}.yaml"
    if not path.is_file():
        available = ", ".join(sorted(p.stem for p in folder.glob("*.yaml")))
        raise ReportError(f"no experiment preset {experiment!r}; available: {available}")
    node = OmegaConf.load(path).get("report")
    return OmegaConf.to_container(node, resolve=False) if node is not None else {}


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


def _write_markdown(path: Path, root: Path, cfg: dict[str, Any], sections: list[tuple[str, list, list[str]]],
                    failed: list[Job], images: list[Path]) -> None:
    """table.md: the title, the command that ran the sweep (every override it was given), the notes,
    the configurations' table, the analyses, the failed jobs, the plots."""
    (title, rows, columns), *analyses = sections
    md = [f"# {title}\n", f"{len(rows)} configurations from `{root}`" + (f", {len(failed)} failed job(s)" if failed
                                                                       else "") + "\n"]
    if command := run_command(root):
        md.append(f"\nRun by `{command}`\n\n")
    if cfg.get("notes"):
        md.append(str(cfg["notes"]).strip() + "\n")
    md.append(_markdown(rows, columns))
    for name, section_rows, section_columns in analyses:
        md += [f"\n## {name}\n", _markdown(section_rows, section_columns)]
    if failed:
        md += ["\n## Failed jobs\n", *(f"- `{j.path}`: {j.error}\n" for j in failed)]
    md += ["\n", *(f"![{p.stem}]({p.name})\n" for p in images)]
    write_text(path, "".join(md))


def _config(collection: Collection, override: dict[str, Any] | None) -> dict[str, Any]:
    cfg = override if override is not None else collection.report or {}
    reject_unknown(cfg, REPORT_KEYS, "report")
    return cfg


def _default_plots(keys: list[str], rows: list[dict[str, Any]], metrics: list[str]) -> list[PlotSpec]:
    axes = [k for k in keys if k != REPEAT_KEY]
    if not axes:
        return []
    numeric = [k for k in axes if all(is_number(r.get(k)) for r in rows)]
    x = (numeric or axes)[0]
    return [PlotSpec(name=f"{m}_vs_{x}", x=x, y=(m,)) for m in metrics[:2]]


def build_report(
    root: Path, out_dir: Path | None = None, *, report: dict[str, Any] | None = None, console: Console | None = None
) -> Report:
    """Collect `root`, write results.csv, aggregate.csv, table.md and the PNGs into `out_dir` (default
    `root`), print the tables, and return what was written. `report` replaces the `report` node the
    jobs ran with. Raises ReportError on unreadable input."""
    collection = collect(root)
    cfg = _config(collection, report)
    out_dir = out_dir or root
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot write the report into {out_dir}: {e.strerror or e}") from e
    keys = list(collection.swept)
    rows = job_rows(collection)
    summary_keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in keys and k != "job"]
    aggregated = aggregate(rows, keys, summary_keys)
    metrics = [m for m in (cfg.get("metrics") or DEFAULT_METRICS) if any(m in r for r in rows)]
    spec = Sustainable.from_config(cfg["sustainable"]) if cfg.get("sustainable") else None
    config_keys = [k for k in keys if k != REPEAT_KEY]
    derived = sustainable_rates(aggregated, config_keys, spec) if spec else []
    ratio = Ratio.from_config(cfg["ratio"]) if cfg.get("ratio") else None
    relative = ratios(aggregated, config_keys, ratio) if ratio else []
    points = [PaperPoint.from_config(p) for p in cfg.get("paper") or []]
    comparisons = compare(points, aggregated + derived + relative)
    specs = [PlotSpec.from_config(p) for p in cfg["plots"]] if cfg.get("plots") else _default_plots(keys, rows, metrics)
    images = [p for s in specs if (p := plot(aggregated, config_keys, s, out_dir)) is not None]

    _write_csv(out_dir / "results.csv", rows)
    _write_csv(out_dir / "aggregate.csv", aggregated)
    title = cfg.get("title") or collection.experiment or str(root)
    sections = [(title, aggregated, [*config_keys, *(["n"] if REPEAT_KEY in keys else []), *metrics])]
    if derived:
        sections.append((f"Sustainable rate ({spec.metric} <= {spec.threshold})", derived, _columns(derived)))
    if relative:
        sections.append((f"{ratio.metric} over {ratio.line}={ratio.baseline}", relative, _columns(relative)))
    if comparisons:
        sections.append(("Against the paper", comparisons, COMPARE_COLUMNS))
    _write_markdown(out_dir / "table.md", root, cfg, sections, collection.failed, images)
    console = console or Console()
    for name, section_rows, columns in sections:
        console.print(_rich(name, section_rows, columns))
    for job in collection.failed:
        console.print(f"[red]failed[/red] {job.path}: {job.error}")
    return Report(out_dir, rows, aggregated, derived, relative, comparisons, collection.failed, images,
                  collection.experiment)
