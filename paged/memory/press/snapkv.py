"""SnapKV (Li et al., 2024): what the prompt's last queries attend to predicts what generation will read."""

from __future__ import annotations

import numpy as np

from paged.config import ConfigError
from paged.memory.press.kv_press import KVPress, PressView, recent


def pooled(scores: np.ndarray, kernel: int) -> np.ndarray:
    """`scores` averaged over a centred window of `kernel` tokens (clipped at the ends), so that a
    kept token brings its neighbours: SnapKV's pooling, which keeps phrases rather than lone tokens."""
    if kernel <= 1 or scores.shape[0] == 0:
        return scores
    sums = np.concatenate([[0.0], np.cumsum(scores, dtype=np.float64)])
    index = np.arange(scores.shape[0])
    lo, hi = np.maximum(index - kernel // 2, 0), np.minimum(index + kernel // 2 + 1, scores.shape[0])
    return (sums[hi] - sums[lo]) / (hi - lo)


class SnapKVPress(KVPress):
    """Keeps the recent `window` and, of the tokens before it, those the last `queries` queries of
    the judging step (the prompt's, after prefill) attend to most, their mass pooled over `kernel`
    neighbouring tokens.

    One keep set serves every layer and KV head, chosen by the mass summed over heads and averaged
    over layers, where SnapKV keeps a set per layer and KV head: a needle that a few retrieval heads
    read is outvoted by the heads that read the recent text (on SmolLM2's needle prompts at 4x, 2/6
    found, against 4/6 with per-head sets: experiments/kv_press_reference.py)."""

    name = "snapkv"
    needs_scores = True

    def __init__(
        self, queries: int = 32, kernel: int = 7, ratio: float | None = None, max_tokens: int | None = None,
        window: int = 0, interval: int = 0,
    ) -> None:
        super().__init__(ratio, max_tokens, window, interval)
        if queries < 1:
            raise ConfigError(f"kv_press.queries={queries!r} must be >= 1 (the last queries that score tokens)")
        if kernel < 1:
            raise ConfigError(f"kv_press.kernel={kernel!r} must be >= 1 (tokens each score is pooled over)")
        self.queries = queries
        self.kernel = kernel

    @property
    def score_queries(self) -> int | None:
        return self.queries

    def select(self, view: PressView, budget: int) -> np.ndarray:
        assert view.scores is not None, "snapkv needs the step's attention mass"
        protected = recent(view.num_held, self.window)
        older = view.num_held - protected.shape[0]
        # a stable sort: of equal scores the earlier token stays
        chosen = np.argsort(-pooled(view.scores[:older], self.kernel), kind="stable")[: budget - protected.shape[0]]
        return np.concatenate([chosen, protected])
