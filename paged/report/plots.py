"""Matplotlib figures of a sweep: a metric against a swept key, one line per other configuration,
repeats as median with a min-max bar; or the KV memory breakdown as stacked bars."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paged.report.collect import ReportError, reject_unknown
from paged.report.table import is_number, select
from paged.utils.atomic_file import atomic_open

KINDS = ("line", "stacked")


@dataclass(frozen=True)
class PlotSpec:
    name: str  # the PNG's file stem
    x: str
    y: tuple[str, ...]  # one metric for a line plot; the stacked shares for a stacked plot
    kind: str = "line"
    facet: str | None = None  # one panel per value of this key
    where: tuple[tuple[str, Any], ...] = ()  # only these rows
    logx: bool = False
    logy: bool = False
    title: str = ""
    ylabel: str = ""
    hline: float | None = None  # a reference level, e.g. the sustainable-rate threshold

    @classmethod
    def from_config(cls, node: dict[str, Any]) -> PlotSpec:
        reject_unknown(node, set(cls.__dataclass_fields__), f"report.plots entry {node}")
        if node.get("kind", "line") not in KINDS:
            raise ReportError(f"report.plots kind={node['kind']!r}; allowed: {list(KINDS)}")
        y = node.get("y")
        ys = tuple(y) if isinstance(y, list | tuple) else (y,)
        name = node.get("name") or f"{'_'.join(ys)}_vs_{node.get('x')}"
        return cls(**{**node, "name": name, "y": ys, "where": tuple((node.get("where") or {}).items())})


def _label(row: dict[str, Any], keys: list[str]) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={row.get(k)}" for k in keys) or "all"


def _line_panel(ax: Any, rows: list[dict[str, Any]], spec: PlotSpec, line_keys: list[str]) -> None:
    metric = spec.y[0]
    numeric_x = all(is_number(r.get(spec.x)) for r in rows)
    categories = list(dict.fromkeys(str(r.get(spec.x)) for r in rows))
    lines: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if is_number(row.get(metric)):
            lines.setdefault(_label(row, line_keys), []).append(row)
    for label, members in lines.items():
        members.sort(key=lambda r: r[spec.x] if numeric_x else categories.index(str(r[spec.x])))
        xs = [r[spec.x] if numeric_x else categories.index(str(r[spec.x])) for r in members]
        ys = [r[metric] for r in members]
        low = [y - r.get(f"{metric}_min", y) for r, y in zip(members, ys)]
        high = [r.get(f"{metric}_max", y) - y for r, y in zip(members, ys)]
        ax.errorbar(xs, ys, yerr=[low, high] if any(low) or any(high) else None, marker="o", capsize=3, label=label)
    if not numeric_x:
        ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_xlabel(spec.x)
    ax.set_ylabel(spec.ylabel or metric)
    if spec.logx:
        ax.set_xscale("log", base=2)
    if spec.logy:
        ax.set_yscale("log")
    if lines:
        ax.legend(fontsize=7)


def _stacked_panel(ax: Any, rows: list[dict[str, Any]], spec: PlotSpec, keys: list[str]) -> None:
    labels = [_label(r, keys) for r in rows]
    bottom = [0.0] * len(rows)
    for metric in spec.y:
        values = [float(r.get(metric) or 0.0) for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=metric)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(spec.ylabel or "share")
    ax.legend(fontsize=7)


def plot(rows: list[dict[str, Any]], keys: list[str], spec: PlotSpec, out_dir: Path) -> Path | None:
    """Writes `<out_dir>/<spec.name>.png`; None when no row has the plot's metric."""
    rows = select(rows, dict(spec.where))
    if spec.x not in keys and spec.kind == "line":
        raise ReportError(f"plot {spec.name!r}: x={spec.x!r} is not a swept key; swept: {keys}")
    if not any(is_number(r.get(m)) for r in rows for m in spec.y):
        return None
    facets = list(dict.fromkeys(r.get(spec.facet) for r in rows)) if spec.facet else [None]
    # imported here: every run.py process imports the report package (a sweep's callback), and
    # matplotlib costs ~0.8 s of start-up that only a report that draws needs
    import matplotlib

    matplotlib.use("Agg")  # files only: a sweep may run on a cluster node without a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(facets), figsize=(5 * len(facets), 4), squeeze=False)
    other = [k for k in keys if k not in (spec.x, spec.facet, "repeat") and k not in dict(spec.where)]
    for ax, value in zip(axes[0], facets):
        panel = [r for r in rows if spec.facet is None or r.get(spec.facet) == value]
        if spec.kind == "line":
            _line_panel(ax, panel, spec, other)
        else:
            _stacked_panel(ax, panel, spec, [k for k in keys if k not in (spec.facet, "repeat")])
        if spec.hline is not None:
            ax.axhline(spec.hline, color="grey", linestyle="--", linewidth=1)
        if spec.facet:
            ax.set_title(f"{spec.facet}={value}", fontsize=9)
        ax.grid(alpha=0.3)
    if spec.title:
        fig.suptitle(spec.title)
    fig.tight_layout()
    path = out_dir / f"{spec.name}.png"
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return path
