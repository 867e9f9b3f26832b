"""PagedEviction (2025)-style block eviction: whole blocks scored by ||V|| / ||K||, no kernel change."""

from __future__ import annotations

import numpy as np

from paged.memory.press.kv_press import KVPress, PressView


class BlockNormPress(KVPress):
    """Keeps whole blocks of the table: the ones the recent `window` touches (with the last, partly
    filled block) and, of the full blocks before them, those whose tokens' mean ||V|| / ||K|| is
    highest, as many as the budget holds. A kept full block is reused in place, never copied."""

    name = "block-norm"
    needs_norms = True

    def select(self, view: PressView, budget: int) -> np.ndarray:
        assert view.key_norms is not None and view.value_norms is not None, "block-norm needs the executor's norms"
        n, bs = view.num_held, view.block_size
        first_protected = min((n - self.window) // bs, (n - 1) // bs)  # the last block is always kept
        protected = np.arange(first_protected * bs, n)
        room = (budget - protected.shape[0]) // bs
        if room <= 0 or first_protected == 0:
            return protected
        ratio = view.value_norms[: first_protected * bs] / np.maximum(view.key_norms[: first_protected * bs], 1e-12)
        scores = ratio.reshape(first_protected, bs).mean(axis=1)
        blocks = np.sort(np.argsort(-scores, kind="stable")[:room])
        return np.concatenate([(blocks[:, None] * bs + np.arange(bs)).reshape(-1), protected])
