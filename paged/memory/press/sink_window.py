"""StreamingLLM (Xiao et al., 2023): the first `sink` tokens (attention sinks) and the most recent ones."""

from __future__ import annotations

import numpy as np

from paged.config import ConfigError
from paged.memory.press.kv_press import KVPress, PressView, recent


class SinkWindowPress(KVPress):
    """Keeps the first `sink` held tokens and fills the rest of the budget with the latest ones;
    needs no scores."""

    name = "sink-window"

    def __init__(
        self, sink: int = 4, ratio: float | None = None, max_tokens: int | None = None, window: int = 0,
        interval: int = 0,
    ) -> None:
        super().__init__(ratio, max_tokens, window, interval)
        if sink < 0:
            raise ConfigError(f"kv_press.sink={sink!r} must be >= 0 (attention-sink tokens kept at the start)")
        if self.max_tokens is not None and sink + self.window > self.max_tokens:
            raise ConfigError(f"kv_press.sink={sink} plus kv_press.window={self.window} is larger than the budget "
                              f"kv_press.max_tokens={self.max_tokens}")
        self.sink = sink

    @property
    def protected(self) -> int:
        return self.sink + self.window

    def select(self, view: PressView, budget: int) -> np.ndarray:
        return np.concatenate([np.arange(self.sink), recent(view.num_held, budget - self.sink)])
