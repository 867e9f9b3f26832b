"""Key-norm scoring (Devoto et al., 2024): keys of small L2 norm draw the most attention; no scores needed."""

from __future__ import annotations

import numpy as np

from paged.memory.press.kv_press import KVPress, PressView, recent


class KnormPress(KVPress):
    """Keeps the recent `window` and, of the tokens before it, those whose keys have the smallest norms."""

    name = "knorm"
    needs_norms = True

    def select(self, view: PressView, budget: int) -> np.ndarray:
        assert view.key_norms is not None, "knorm needs the executor's key norms"
        protected = recent(view.num_held, self.window)
        older = view.num_held - protected.shape[0]
        # a stable sort: of equal norms the earlier token stays
        chosen = np.argsort(view.key_norms[:older], kind="stable")[: budget - protected.shape[0]]
        return np.concatenate([chosen, protected])
