"""Synthetic lengths: a log-normal fit to a dataset's mean prompt and output lengths.

The PagedAttention paper evaluates on ShareGPT (mean prompt 161.31, output 337.99 tokens) and Alpaca
(19.31, 58.45) and quotes only those means, not the datasets' spread. So this source is a *fit*,
not the datasets: it assumes sigma = 1.0 for the log-length and sets mu so the means match
(`prompt_len_mean`, `output_len_mean`; conf/workload/sharegpt.yaml and alpaca.yaml are the paper's
two). The lengths are scaled by `length_scale` (a CPU run uses shorter requests of the same shape)
and clipped to [`*_len_min`, `*_len_max`]; arrivals are Poisson at `arrival_rate`.
"""

from __future__ import annotations

import numpy as np

from paged.config import WorkloadConfig
from paged.workload.lengths import Lengths
from paged.workload.records import arrivals

_LOGNORMAL_SIGMA = 1.0


def synthetic_lengths(cfg: WorkloadConfig, rng: np.random.Generator) -> Lengths:
    """`num_requests` prompt and output lengths, then their arrivals, from the request stream `rng`."""
    n = cfg.num_requests
    prompt = _lognormal_lengths(
        rng, cfg.prompt_len_mean * cfg.length_scale, n, cfg.prompt_len_min, cfg.prompt_len_max
    )
    output = _lognormal_lengths(
        rng, cfg.output_len_mean * cfg.length_scale, n, cfg.output_len_min, cfg.output_len_max
    )
    return Lengths(prompt, output, arrivals(rng, cfg.arrival_rate, n))


def _lognormal_lengths(
    rng: np.random.Generator, mean: float, n: int, lo: int, hi: int | None
) -> np.ndarray:
    mu = np.log(mean) - _LOGNORMAL_SIGMA**2 / 2
    return np.clip(np.round(rng.lognormal(mu, _LOGNORMAL_SIGMA, n)), lo, hi).astype(np.int64)
