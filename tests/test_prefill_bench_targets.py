"""experiments/gpu/prefill_bench.py's target lines (issue 44): the lowest cuda / sdpa-flash ratio
against the 70% aim and the 50% floor, the lowest over a cached prefix against 100%, on ratios made
up to sit either side of each bar."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments" / "gpu"))
from prefill_bench import flash_targets  # noqa: E402


def test_between_the_floor_and_the_aim_the_floor_is_met_and_the_aim_not() -> None:
    lines = flash_targets([(88.0, "Llama-3-8B layer, 16 seqs x 512"), (61.0, "Llama-3-8B layer, 4 seqs x 2048"),
                           (104.0, "SmolLM2-135M, 64 seqs, 512 cached + 32 new"),
                           (99.0, "Llama-3-8B layer, 64 seqs, 512 cached + 32 new")])
    assert lines == [
        "cuda / sdpa-flash throughput, lowest: 61% (Llama-3-8B layer, 4 seqs x 2048); target >= 70%: NOT met; "
        "floor >= 50%: met",
        "cuda / sdpa-flash over a cached prefix, lowest: 99% (Llama-3-8B layer, 64 seqs, 512 cached + 32 new); "
        "target >= 100%: NOT met",
    ]


def test_every_bar_met_and_none_below_the_floor() -> None:
    met = flash_targets([(72.0, "a, 16 seqs x 512"), (101.0, "a, 64 seqs, 512 cached + 32 new")])
    assert met[0].endswith("target >= 70%: met; floor >= 50%: met") and met[1].endswith("target >= 100%: met")
    low = flash_targets([(49.0, "a, 4 seqs x 2048")])
    assert low == ["cuda / sdpa-flash throughput, lowest: 49% (a, 4 seqs x 2048); target >= 70%: NOT met; "
                   "floor >= 50%: NOT met"]
    assert flash_targets([]) == []
