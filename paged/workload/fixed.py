"""Fixed lengths: every request has exactly `prompt_len` prompt tokens and `output_len` output tokens.

No length spread, so a run measures the system at one operating point (a microbenchmark, or a
sweep over lengths). The first `shared_prefix_len` of the `prompt_len` tokens are the shared
prefix; arrivals are Poisson at `arrival_rate`.
"""

from __future__ import annotations

import numpy as np

from paged.config import WorkloadConfig
from paged.workload.lengths import Lengths
from paged.workload.records import arrivals


def fixed_lengths(cfg: WorkloadConfig, rng: np.random.Generator) -> Lengths:
    """`num_requests` equal lengths (the prompt's after the shared prefix) and their arrivals."""
    n = cfg.num_requests
    body = np.full(n, cfg.prompt_len - cfg.shared_prefix_len, dtype=np.int64)
    return Lengths(body, np.full(n, cfg.output_len, dtype=np.int64), arrivals(rng, cfg.arrival_rate, n))
