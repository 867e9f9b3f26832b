"""Inter-token latency (ITL) statistics over every finished request's token gaps, pooled.

A fleet hour pools ~30M gaps (8 bytes each). np.percentile and np.median partition a copy of their
input and np.std subtracts the mean into a temporary of the same size, so summarising the gaps
used to take three times their memory at the run's peak. Here the gaps are written into one array
and summarised within it: the mean as np.mean takes it, the deviation by np.std's arithmetic on
chunks cut where numpy's pairwise summation cuts (so its sum is numpy's to the bit), then the
percentiles with `overwrite_input` (they only reorder the array, which is no longer needed).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

# the largest chunk whose squared deviations are summed in one temporary (8 MiB of float64); at
# least numpy's pairwise block (128), below which it sums with 8 accumulators instead of halving
_CHUNK = 1 << 20


def pooled_gaps(times: list[array[float]]) -> np.ndarray:
    """Every gap between the steps that gave a finished request tokens, pooled (vLLM's ITL): written
    into one array, not gathered and copied."""
    out = np.empty(sum(max(len(t) - 1, 0) for t in times))
    start = 0
    for t in times:
        if len(t) > 1:
            values = np.asarray(t, dtype=np.float64)
            np.subtract(values[1:], values[:-1], out=out[start:start + len(t) - 1])
            start += len(t) - 1
    return out


@dataclass(frozen=True)
class GapStats:
    """What the summary reports of the pooled gaps, each as numpy computes it on the whole array."""

    mean: float
    std: float
    median: float
    p50: float
    p90: float
    p99: float


def _squared_deviations(values: np.ndarray, mean: float) -> float:
    """np.add.reduce((values - mean) ** 2) without the full-size temporary: numpy's pairwise sum
    halves a range (rounded down to a multiple of 8) until it is small, so summing each half's
    result reproduces its sum exactly."""
    n = values.shape[0]
    if n <= _CHUNK:
        x = values - mean
        np.multiply(x, x, out=x)
        return float(np.add.reduce(x))
    half = n // 2
    half -= half % 8
    return _squared_deviations(values[:half], mean) + _squared_deviations(values[half:], mean)


def gap_stats(gaps: np.ndarray) -> GapStats | None:
    """The gaps' statistics, consuming `gaps` (the percentiles reorder it); None without gaps."""
    n = gaps.shape[0]
    if not n:
        return None
    mean = np.add.reduce(gaps) / n  # np.mean's arithmetic
    std = np.sqrt(_squared_deviations(gaps, mean) / n)  # np.std's (the population deviation)
    # the percentiles first: np.median then reads the same values in another order
    p50, p90, p99 = np.percentile(gaps, [50, 90, 99], overwrite_input=True)
    median = np.median(gaps, overwrite_input=True)
    return GapStats(float(mean), float(std), float(median), float(p50), float(p90), float(p99))
