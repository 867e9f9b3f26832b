"""H2O (Zhang et al., 2023): heavy hitters, the tokens that have drawn the most attention so far."""

from __future__ import annotations

import numpy as np

from paged.config import ConfigError
from paged.memory.press.kv_press import KVPress, PressView, recent


class H2OPress(KVPress):
    """Keeps the most recent tokens, `recent_share` of the budget (at least the `window`), and fills
    the rest with the heavy hitters before them: the tokens with the largest attention mass
    accumulated over every query since they were cached (the prompt's, then each decode step's).

    The paper splits its budget half heavy hitters, half recent tokens (`recent_share` 0.5). The
    recent half matters more here than in a decode-time eviction: judged after the prompt, an early
    token has been seen by every later query, so the summed mass favours the start of the prompt and
    a small window alone loses the context the next tokens read (on SmolLM2 at 2x, +20% perplexity
    with a 32-token window, -1% with half the budget recent: experiments/kv_press_h2o_check.py)."""

    name = "h2o"
    needs_scores = True
    accumulates = True

    def __init__(
        self, recent_share: float = 0.5, ratio: float | None = None, max_tokens: int | None = None, window: int = 0,
        interval: int = 0,
    ) -> None:
        super().__init__(ratio, max_tokens, window, interval)
        if not 0 <= recent_share <= 1:
            raise ConfigError(f"kv_press.recent_share={recent_share!r} must be in [0, 1] (the share of the budget "
                              "kept as the most recent tokens; H2O's is 0.5)")
        self.recent_share = recent_share

    def select(self, view: PressView, budget: int) -> np.ndarray:
        assert view.scores is not None, "h2o needs the accumulated attention mass"
        protected = recent(view.num_held, max(self.window, int(budget * self.recent_share)))
        older = view.num_held - protected.shape[0]
        chosen = np.argsort(-view.scores[:older], kind="stable")[: budget - protected.shape[0]]
        return np.concatenate([chosen, protected])
