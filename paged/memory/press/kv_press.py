"""The KV compression seam (`kv_press`): which of a sequence's held tokens stay in the cache.

After a sequence's prompt is computed (and, with `interval` N > 0, every N decode steps after it),
the scheduler shows the press what it can see of the sequence (`PressView`): the original position
of every token it holds, and for a press that asks, the norms of their keys and values. The press
returns the held indices to keep; the block manager compacts them into fewer blocks and frees the
rest (`paged.memory.compaction`). A press that `needs_scores` also sees each held token's attention
mass (`KernelBackend.attention_mass`): from the last `score_queries` queries of the step that judges
it, or, for a press that `accumulates`, summed over every step since the token was cached.

A press has a budget: `ratio` r keeps ceil(L / r) of a sequence's L tokens, `max_tokens` at most
that many; the last `window` held tokens are always kept. A sequence that holds no more than its
budget is not touched. A new press is one file here plus one YAML in conf/kv_press.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from paged.config import ConfigError


@dataclass(frozen=True)
class PressView:
    """What a press sees of one sequence: per held token (in table order, which is position order)
    its original `positions` (RoPE was applied with them before caching), and when the press
    `needs_norms`, the L2 norms of its key and value, averaged over the layers of the KV group judged
    and the KV heads. With several KV groups the press sees one view per full-attention group and must
    keep as many tokens in each (`paged.memory.group_compaction`)."""

    positions: np.ndarray  # int64 [n], ascending
    num_positions: int  # tokens computed so far: the sequence's length before any compression
    block_size: int
    key_norms: np.ndarray | None = None  # float32 [n]
    value_norms: np.ndarray | None = None  # float32 [n]
    scores: np.ndarray | None = None  # float32 [n], attention mass, when the press `needs_scores`

    @property
    def num_held(self) -> int:
        return self.positions.shape[0]


class KVPress(ABC):
    """A compression policy: `select` chooses `budget` held tokens to keep (indices into the view)."""

    # the config's name (`kv_press=<name>`)
    name: ClassVar[str]
    # whether `select` reads `PressView.key_norms` / `value_norms` (the executor must compute them)
    needs_norms: ClassVar[bool] = False
    # whether `select` reads `PressView.scores` (the executor must compute the attention mass), and whether
    # they are summed over every step (H2O) rather than taken from the judging step's queries alone
    needs_scores: ClassVar[bool] = False
    accumulates: ClassVar[bool] = False

    @property
    def score_queries(self) -> int | None:
        """How many of a row's last queries score its tokens (None: every query of the step)."""
        return None

    def __init__(
        self, ratio: float | None = None, max_tokens: int | None = None, window: int = 0, interval: int = 0
    ) -> None:
        if (ratio is None) == (max_tokens is None):
            raise ConfigError(f"kv_press={self.name} needs exactly one budget: kv_press.ratio (keep 1/ratio of the "
                              f"tokens) or kv_press.max_tokens, got ratio={ratio!r}, max_tokens={max_tokens!r}")
        if ratio is not None and not ratio > 1:
            raise ConfigError(f"kv_press.ratio={ratio!r} must be > 1 (keep 1/ratio of a sequence's tokens)")
        if max_tokens is not None and max_tokens < 1:
            raise ConfigError(f"kv_press.max_tokens={max_tokens!r} must be a positive number of tokens")
        if window < 0:
            raise ConfigError(f"kv_press.window={window!r} must be >= 0 (recent tokens always kept)")
        if max_tokens is not None and window > max_tokens:
            raise ConfigError(f"kv_press.window={window} is larger than the budget kv_press.max_tokens={max_tokens}; "
                              "keep it at most that")
        if interval < 0:
            raise ConfigError(f"kv_press.interval={interval!r} must be >= 0 (0: compress only after the prompt)")
        self.ratio = ratio
        self.max_tokens = max_tokens
        self.window = window
        self.interval = interval

    def check_context(self, max_model_len: int) -> None:
        """A budget that can never compress a sequence of at most `max_model_len` tokens is an error."""
        if self.ratio is not None and self.ratio >= max_model_len:
            raise ConfigError(f"kv_press.ratio={self.ratio} is >= scheduler.max_model_len={max_model_len}: it would "
                              "keep less than one token of the longest sequence")
        if self.max_tokens is not None and self.max_tokens >= max_model_len:
            raise ConfigError(f"kv_press.max_tokens={self.max_tokens} is >= scheduler.max_model_len={max_model_len}: "
                              "no sequence would ever be compressed")

    @property
    def protected(self) -> int:
        """Held tokens every selection keeps whatever the budget (a ratio's budget may be smaller)."""
        return self.window

    def budget(self, num_positions: int) -> int:
        """Tokens a sequence of `num_positions` tokens may hold."""
        limit = math.ceil(num_positions / self.ratio) if self.ratio is not None else self.max_tokens
        assert limit is not None
        return max(limit, self.protected)

    def keep(self, view: PressView) -> np.ndarray | None:
        """The held indices to keep, ascending; None when the sequence holds no more than its budget
        (or the press keeps every held token)."""
        budget = self.budget(view.num_positions)
        if view.num_held <= budget:
            return None
        kept = np.unique(self.select(view, budget))
        assert kept.shape[0] == 0 or 0 <= kept[0] and kept[-1] < view.num_held, kept
        return kept if kept.shape[0] < view.num_held else None

    @abstractmethod
    def select(self, view: PressView, budget: int) -> np.ndarray:
        """`budget` distinct held indices to keep (`budget` < `view.num_held`), the last `protected`
        among them; a block-granular press may round to whole blocks."""


def recent(num_held: int, count: int) -> np.ndarray:
    """The indices of the last `count` held tokens."""
    return np.arange(max(num_held - count, 0), num_held)
