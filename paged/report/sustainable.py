"""The paper's throughput measure: the highest request rate a system sustains before its latency
explodes (Fig. 12, 16), read off a rate sweep, and its ratio to a baseline system's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged.report.collect import ReportError, reject_unknown
from paged.report.table import is_number


@dataclass(frozen=True)
class Sustainable:
    x: str  # the swept rate key, e.g. workload.arrival_rate
    line: str  # the key whose values are the systems compared, e.g. allocator
    metric: str = "normalized_latency_s_per_token"
    threshold: float = 0.5  # the metric's value at which latency counts as exploded
    baselines: tuple[str, ...] = ()  # values of `line` every other system is divided by

    @classmethod
    def from_config(cls, node: dict[str, Any]) -> Sustainable:
        reject_unknown(node, {"x", "line", "metric", "threshold", "baselines"}, "report.sustainable")
        if "x" not in node or "line" not in node:
            raise ReportError(f"report.sustainable needs `x` (the rate key) and `line` (the system key), got {node}")
        return cls(node["x"], node["line"], node.get("metric", cls.metric), float(node.get("threshold", cls.threshold)),
                   tuple(str(b) for b in node.get("baselines", ())))


def crossing(points: list[tuple[float, float]], threshold: float) -> tuple[float | None, str]:
    """The rate at which the metric first exceeds `threshold`, linearly interpolated between the two
    swept rates around it, with a bound: "<" (already over at the lowest rate) or ">=" (never over)."""
    points = sorted(points)
    if not points:
        return None, ""
    if points[0][1] > threshold:
        return points[0][0], "<"
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if y1 > threshold:
            return x0 + (threshold - y0) / (y1 - y0) * (x1 - x0), ""
    return points[-1][0], ">="


# a rate known only as a bound makes its ratio a bound: (numerator's bound, denominator's) -> ratio's
_RATIO_BOUNDS = {("", ""): "", (">=", ""): ">=", ("", "<"): ">=", (">=", "<"): ">=", ("<", ""): "<",
                 ("", ">="): "<", ("<", ">="): "<"}


def _ratio(num: tuple[float | None, str], den: tuple[float | None, str]) -> tuple[float | None, str]:
    """`num / den` and whether it is exact (""), at least (">=") or below ("<") that; None when the
    bounds point different ways (one system never exploded, the other already had)."""
    (rate, bound), (base, base_bound) = num, den
    if rate is None or not base or (bound, base_bound) not in _RATIO_BOUNDS:
        return None, ""
    return rate / base, _RATIO_BOUNDS[bound, base_bound]


def sustainable_rates(rows: list[dict[str, Any]], keys: list[str], spec: Sustainable) -> list[dict[str, Any]]:
    """One row per (other keys, system): `sustainable_rate`, `sustainable_rate_bound`, and per
    baseline `sustainable_rate_ratio_over_<baseline>` with its `_bound`."""
    for key in (spec.x, spec.line):
        if key not in keys:
            raise ReportError(f"report.sustainable: {key!r} is not a swept key of this sweep; swept: {keys}")
    group_keys = [k for k in keys if k not in (spec.x, spec.line)]
    curves: dict[tuple, dict[str, list[tuple[float, float]]]] = {}
    for row in rows:
        if is_number(row.get(spec.metric)) and is_number(row.get(spec.x)):
            group = tuple(row.get(k) for k in group_keys)
            curves.setdefault(group, {}).setdefault(str(row[spec.line]), []).append((row[spec.x], row[spec.metric]))
    out = []
    for group, systems in curves.items():
        rates = {name: crossing(points, spec.threshold) for name, points in systems.items()}
        for name, (rate, bound) in rates.items():
            row = dict(zip(group_keys, group)) | {spec.line: name, "sustainable_rate": rate,
                                                  "sustainable_rate_bound": bound}
            for base in spec.baselines:
                ratio, ratio_bound = _ratio((rate, bound), rates.get(base, (None, "")))
                row[f"sustainable_rate_ratio_over_{base}"] = ratio
                row[f"sustainable_rate_ratio_over_{base}_bound"] = ratio_bound
            out.append(row)
    return out
