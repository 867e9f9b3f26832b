"""Service-level objectives and goodput: how many requests a run served well enough, not just served.

DistServe's measure: a request meets the SLOs when its TTFT and its TPOT are both within theirs
(`slo.ttft_s`, `slo.tpot_s`; one not given is met by every request, and a request of a single output
token has no TPOT, so it meets that one). Goodput is such finished requests per second of the run;
attainment their share of all the requests it was given.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def goodput(
    latencies: Iterable[tuple[float | None, float | None]], num_requests: int, wall_s: float,
    slo_ttft_s: float | None, slo_tpot_s: float | None,
) -> dict[str, Any]:
    """`goodput` (requests/s) and `slo_attainment` over the finished requests' (TTFT, TPOT) in
    `latencies`, and the SLOs themselves; all null when neither SLO is given."""
    if slo_ttft_s is None and slo_tpot_s is None:
        return {"slo_ttft_s": None, "slo_tpot_s": None, "goodput": None, "slo_attainment": None}
    met = sum(
        (slo_ttft_s is None or (ttft is not None and ttft <= slo_ttft_s))
        and (slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s)
        for ttft, tpot in latencies
    )
    return {
        "slo_ttft_s": slo_ttft_s,
        "slo_tpot_s": slo_tpot_s,
        "goodput": met / wall_s if wall_s > 0 else 0.0,
        "slo_attainment": met / num_requests if num_requests else None,
    }
