"""How requests pick among the `num_prefixes` shared prefixes: `workload.prefix_popularity`.

`uniform` (the default) gives every prefix the same chance, the draw every workload had before this
key. `zipf` gives prefix k the weight 1/(k+1)^s (`prefix_zipf_s`, default 1.0): a few prefixes are
hot and a long tail is cold, as a cache sees real system prompts and documents, so eviction policies
that weigh reuse frequency can be told apart from LRU. Both draw from the seeded stream
`default_rng([seed, PREFIX_CHOICE_STREAM])`, so the same seed picks the same prefixes.
"""

from __future__ import annotations

import math

import numpy as np

from paged.config import ConfigError, WorkloadConfig
from paged.workload.records import PREFIX_CHOICE_STREAM

POPULARITIES = ("uniform", "zipf")


def check_popularity(cfg: WorkloadConfig) -> None:
    """A one-line ConfigError for an unknown popularity or a Zipf exponent that is not > 0."""
    if cfg.prefix_popularity not in POPULARITIES:
        raise ConfigError(
            f"workload.prefix_popularity={cfg.prefix_popularity!r} is not supported; allowed: {', '.join(POPULARITIES)}"
        )
    s = cfg.prefix_zipf_s
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
        raise ConfigError(
            f"workload.prefix_zipf_s={s!r} must be a finite number > 0 (prefix k is drawn with weight 1/(k+1)^s)"
        )


def choose_prefixes(cfg: WorkloadConfig, num_prefixes: int, n: int) -> list[int]:
    """For each of `n` requests (or sessions), the index of its prefix among `num_prefixes`."""
    check_popularity(cfg)
    rng = np.random.default_rng([cfg.seed, PREFIX_CHOICE_STREAM])
    if cfg.prefix_popularity == "uniform":
        return rng.integers(num_prefixes, size=n).tolist()
    weights = 1.0 / np.arange(1, num_prefixes + 1) ** float(cfg.prefix_zipf_s)
    return rng.choice(num_prefixes, size=n, p=weights / weights.sum()).tolist()
