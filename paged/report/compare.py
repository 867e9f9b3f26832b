"""Each result next to the paper's number: the difference, the tolerance, and whether it holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paged.report.collect import ReportError, reject_unknown
from paged.report.table import is_number, select


@dataclass(frozen=True)
class PaperPoint:
    label: str  # what the paper reports, e.g. "Fig. 13 ShareGPT @2 req/s, Orca (Max)"
    metric: str  # a summary key, or a derived one (sustainable_rate_ratio_over_<baseline>)
    where: dict[str, Any]  # the swept keys selecting our row, e.g. {allocator: orca-max}
    value: float | None = None  # the paper's number ...
    low: float | None = None  # ... or the range it gives
    high: float | None = None
    tolerance: float | None = None  # allowed |ours - paper| in the paper's units ...
    rel_tolerance: float | None = None  # ... or as a fraction of the paper's number
    scale: float = 1.0  # ours x scale is in the paper's units (100: a fraction as %)
    note: str = ""  # why it differs, when it does (shown in table.md)

    @classmethod
    def from_config(cls, node: dict[str, Any]) -> PaperPoint:
        reject_unknown(node, set(cls.__dataclass_fields__) | {"range"}, f"report.paper entry {node.get('label', node)}")
        node = dict(node)
        if "range" in node:
            node["low"], node["high"] = node.pop("range")
        for key in ("label", "metric"):
            if key not in node:
                raise ReportError(f"report.paper entry {node}: missing {key!r}")
        point = cls(**{**node, "where": dict(node.get("where") or {})})
        if point.value is None and (point.low is None or point.high is None):
            raise ReportError(f"report.paper entry {point.label!r}: give `value` or `range: [low, high]`")
        return point

    def paper_text(self) -> str:
        return f"{self.value:g}" if self.value is not None else f"{self.low:g} – {self.high:g}"

    def allowed(self) -> float | None:
        if self.tolerance is not None:
            return self.tolerance
        if self.rel_tolerance is not None and self.value is not None:
            return self.rel_tolerance * abs(self.value)
        return None


def _bounded(p: PaperPoint, ours: float, bound: str) -> dict[str, Any]:
    """Ours is only known to be at least (">=") or below ("<") `ours`: outside when even that misses."""
    allowed = p.allowed() or 0.0
    low = p.low if p.value is None else p.value - allowed
    high = p.high if p.value is None else p.value + allowed
    outside = ours > high if bound == ">=" else ours < low
    return {"ours": f"{bound} {ours:.4g}", "verdict": "OUTSIDE" if outside else "inconclusive (a bound)"}


def compare(points: list[PaperPoint], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per paper point: ours, the paper's, the difference and the verdict."""
    out = []
    for p in points:
        matches = [r for r in select(rows, p.where) if p.metric in r]
        row: dict[str, Any] = {"result": p.label, "ours": None, "paper": p.paper_text(), "difference": "",
                               "tolerance": "", "verdict": "", "note": p.note}
        if len(matches) != 1:
            row["verdict"] = f"no row has {p.metric} where {p.where}" if not matches else f"{len(matches)} rows match"
            out.append(row)
            continue
        ours = matches[0][p.metric]
        if not is_number(ours):
            row["verdict"] = f"{p.metric} is {ours!r}"
            out.append(row)
            continue
        ours *= p.scale
        row["ours"] = ours
        bound = matches[0].get(f"{p.metric}_bound")
        if bound:
            row |= _bounded(p, ours, bound)
        elif p.value is not None:
            diff = ours - p.value
            rel = f" ({diff / p.value:+.0%})" if p.value else ""
            row["difference"] = f"{diff:+.3g}{rel}"
            allowed = p.allowed()
            if allowed is not None:
                row["tolerance"] = f"±{allowed:.3g}"
                row["verdict"] = "within" if abs(diff) <= allowed else "OUTSIDE"
        else:
            row["tolerance"] = "the range"
            below, above = ours - p.low, ours - p.high
            row["difference"] = "in range" if below >= 0 >= above else f"{below:+.3g}" if below < 0 else f"{above:+.3g}"
            row["verdict"] = "within" if below >= 0 >= above else "OUTSIDE"
        out.append(row)
    return out
