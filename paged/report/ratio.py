"""One system against another, configuration by configuration: a metric's ratio to a baseline's
(swap over recompute per block size, fp8 over 16-bit per rate, ...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged.report.collect import ReportError, reject_unknown
from paged.report.table import is_number, same


@dataclass(frozen=True)
class Ratio:
    line: str  # the key whose values are compared, e.g. scheduler.preemption_mode
    baseline: str  # its value every other one is divided by, e.g. recompute
    metric: str = "normalized_latency_s_per_token"

    @classmethod
    def from_config(cls, node: dict[str, Any]) -> Ratio:
        reject_unknown(node, {"line", "baseline", "metric"}, "report.ratio")
        if "line" not in node or "baseline" not in node:
            raise ReportError(f"report.ratio needs `line` (the compared key) and `baseline` (its value), got {node}")
        return cls(node["line"], str(node["baseline"]), node.get("metric", cls.metric))

    @property
    def column(self) -> str:
        return f"{self.metric}_over_{self.baseline}"


def ratios(rows: list[dict[str, Any]], keys: list[str], spec: Ratio) -> list[dict[str, Any]]:
    """One row per non-baseline configuration: its other keys, `spec.line`, and `spec.column`."""
    if spec.line not in keys:
        raise ReportError(f"report.ratio: {spec.line!r} is not a swept key of this sweep; swept: {keys}")
    others = [k for k in keys if k != spec.line]
    base = {
        tuple(str(r.get(k)) for k in others): r.get(spec.metric) for r in rows if same(r.get(spec.line), spec.baseline)
    }
    out = []
    for row in rows:
        if same(row.get(spec.line), spec.baseline):
            continue
        denominator = base.get(tuple(str(row.get(k)) for k in others))
        value = row.get(spec.metric)
        ratio = value / denominator if is_number(value) and is_number(denominator) and denominator else None
        out.append({k: row.get(k) for k in others} | {spec.line: row.get(spec.line), spec.column: ratio})
    return out
