"""The step whose attention `torch.ops.paged.attention` runs: vLLM's forward context.

The layer-level torch op takes only a layer's tensors and its index, so that a traced or captured
graph holds nothing of one step; the step's planned attention (its rows, caches and kernels,
`paged.executor.attention.PagedAttention`) is what the executor sets here around the model's
forward, and the op looks it up on every call. Each thread has its own, so two executors in one
process (tensor-parallel ranks on threads, a test's reference beside an engine) never see each
other's step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], object]
"""(layer, q [T, heads, D], k [T, kv_heads, D], v [T, kv_heads, D], out [T, heads, D]): writes the
layer's attention output into `out`"""


class _Current(threading.local):
    attention: LayerAttention | None = None


_CURRENT = _Current()


@contextmanager
def forward_context(attention: LayerAttention) -> Iterator[None]:
    """`attention` serves every `torch.ops.paged.attention` call this thread makes in the block;
    whatever served them before serves them again after it."""
    previous = _CURRENT.attention
    _CURRENT.attention = attention
    try:
        yield
    finally:
        _CURRENT.attention = previous


def current_attention() -> LayerAttention:
    """The attention set by the innermost `forward_context` of this thread."""
    attention = _CURRENT.attention
    if attention is None:
        raise RuntimeError("torch.ops.paged.attention ran outside a forward context: run the model inside "
                           "`with paged.kernels.forward_context.forward_context(step_attention):`, as the "
                           "executor does, or pass the model another attention function")
    return attention
