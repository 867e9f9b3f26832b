"""The sweep as rows: one per job, then one per configuration with repeats folded into median and spread."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

from paged.report.collect import Collection
from paged.report.sweep import REPEAT_KEY


def typed(text: str) -> Any:
    """An override's value as the number it spells (for sorting and axes), else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def job_rows(collection: Collection) -> list[dict[str, Any]]:
    """results.csv: the swept keys, then every summary key, then the job folder."""
    rows = []
    for job in collection.jobs:
        assert job.summary is not None
        row = {key: typed(job.overrides[key]) if key in job.overrides else None for key in collection.swept}
        row |= {k: v for k, v in job.summary.items() if k not in row}
        row["job"] = str(job.path)
        rows.append(row)
    return rows


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def aggregate(rows: list[dict[str, Any]], keys: list[str], metrics: Iterable[str]) -> list[dict[str, Any]]:
    """One row per configuration (`keys` without `repeat`): each metric's median over the repeats,
    with `<metric>_min`, `<metric>_max` and `n` (the number of repeats)."""
    config_keys = [k for k in keys if k != REPEAT_KEY]
    metrics = list(metrics)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(k) for k in config_keys), []).append(row)
    out = []
    for values, members in groups.items():
        agg: dict[str, Any] = dict(zip(config_keys, values))
        agg["n"] = len(members)
        for metric in metrics:
            numbers = [r[metric] for r in members if is_number(r.get(metric))]
            if numbers:
                agg |= {metric: statistics.median(numbers), f"{metric}_min": min(numbers),
                        f"{metric}_max": max(numbers)}
            else:
                # a text metric (the kernel that ran, ...) is the same in every repeat: keep the first
                agg[metric] = members[0].get(metric)
        out.append(agg)
    # numbers by value; names in the order the sweep gave them (opt-13b, opt-66b, opt-175b)
    seen = {k: list(dict.fromkeys(str(r.get(k)) for r in rows)) for k in config_keys}
    return sorted(out, key=lambda r: tuple(
        (0, r[k], 0) if is_number(r.get(k)) else (1, 0, seen[k].index(str(r.get(k)))) for k in config_keys))


def select(rows: list[dict[str, Any]], where: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows whose keys equal `where` (numbers by value: `2` selects `2.0`)."""
    return [r for r in rows if all(same(r.get(k), v) for k, v in where.items())]


def same(a: Any, b: Any) -> bool:
    a, b = typed(str(a)), typed(str(b))
    return float(a) == float(b) if is_number(a) and is_number(b) else str(a) == str(b)
