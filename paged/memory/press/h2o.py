"""H2O (Zhang et al., 2023): heavy hitters, the tokens that have drawn the most attention so far."""

from __future__ import annotations

import numpy as np

from paged.memory.press.kv_press import KVPress, PressView, recent


class H2OPress(KVPress):
    """Keeps the recent `window` and, of the tokens before it, those with the largest attention mass
    accumulated over every query since they were cached (the prompt's, then each decode step's)."""

    name = "h2o"
    needs_scores = True
    accumulates = True

    def select(self, view: PressView, budget: int) -> np.ndarray:
        assert view.scores is not None, "h2o needs the accumulated attention mass"
        protected = recent(view.num_held, self.window)
        older = view.num_held - protected.shape[0]
        chosen = np.argsort(-view.scores[:older], kind="stable")[: budget - protected.shape[0]]
        return np.concatenate([chosen, protected])
