"""The step whose attention `torch.ops.paged.attention` runs: vLLM's forward context.

The layer-level torch op takes only a layer's tensors and its index, so that a traced or captured
graph holds nothing of one step; the step's planned attention (its rows, caches and kernels,
`paged.executor.attention.PagedAttention`) is what the executor sets here around the model's
forward, and the op looks it up on every call. Each thread has its own, so two executors in one
process (tensor-parallel ranks on threads, a test's reference beside an engine) never see each
other's step. Where the step's attention is one that a model may run for all its layers in one
native call (`paged.kernels.stack_attention`), the executor sets that form of it here too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from paged.kernels.stack_attention import StackAttention

LayerAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], object]
"""(layer, q [T, heads, D], k [T, kv_heads, D], v [T, kv_heads, D], out [T, heads, D]): writes the
layer's attention output into `out`"""


class _Current(threading.local):
    attention: LayerAttention | None = None
    stack: StackAttention | None = None


_CURRENT = _Current()


@contextmanager
def forward_context(attention: LayerAttention, stack: StackAttention | None = None) -> Iterator[None]:
    """`attention` serves every `torch.ops.paged.attention` call this thread makes in the block,
    and `stack` (the same attention, where a native call of every layer can run it) is what
    `current_stack` returns there; whatever served them before serves them again after it."""
    previous = _CURRENT.attention, _CURRENT.stack
    _CURRENT.attention, _CURRENT.stack = attention, stack
    try:
        yield
    finally:
        _CURRENT.attention, _CURRENT.stack = previous


def current_stack() -> StackAttention | None:
    """The innermost `forward_context`'s attention as a native call of every layer runs it, or None."""
    return _CURRENT.stack


def current_attention() -> LayerAttention:
    """The attention set by the innermost `forward_context` of this thread."""
    attention = _CURRENT.attention
    if attention is None:
        raise RuntimeError("torch.ops.paged.attention ran outside a forward context: run the model inside "
                           "`with paged.kernels.forward_context.forward_context(step_attention):`, as the "
                           "executor does, or pass the model another attention function")
    return attention
