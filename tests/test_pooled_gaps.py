"""The pooled inter-token gaps' statistics are numpy's on the whole array, to the bit, without its copies."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

import paged.engine.pooled_gaps as pg
from paged.engine.pooled_gaps import gap_stats, pooled_gaps


@pytest.mark.parametrize("n", [1, 2, 7, 9, 127, 4097, 100_003])
@pytest.mark.parametrize("chunk", [128, 1000, 1 << 20])
def test_gap_stats_equal_numpy_whole_array(n: int, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # small chunks make the pairwise halving run many levels deep, as a fleet hour's 30M gaps do
    monkeypatch.setattr(pg, "_CHUNK", chunk)
    gaps = np.random.default_rng(n).gamma(2.0, 0.01, n)
    ref = gaps.copy()
    stats = gap_stats(gaps)
    assert stats is not None
    assert stats.mean == float(np.mean(ref))
    assert stats.std == float(np.std(ref))
    assert stats.median == float(np.median(ref))
    assert (stats.p50, stats.p90, stats.p99) == tuple(float(np.percentile(ref, q)) for q in (50, 90, 99))


def test_gap_stats_without_gaps() -> None:
    assert gap_stats(np.empty(0)) is None


def test_pooled_gaps_in_request_order() -> None:
    times = [array("d", [1.0, 1.5, 3.0]), array("d", [2.0]), array("d"), array("d", [0.0, 0.25])]
    assert pooled_gaps(times).tolist() == [0.5, 1.5, 0.25]
