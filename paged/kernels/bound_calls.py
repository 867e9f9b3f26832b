"""The fused layer ops of a runner backend (cuda, emu) as a model's forward calls them: each layout's
launch bound once (`Runner.bind`), a few µs of host per later call instead of 12-24.

`FusedLayerOpsMixin` checks every argument of every call and builds its launch anew. A model calls
each op once per layer over tensors laid out alike (shapes, strides, dtype, device, 16-byte
alignment) at other addresses: so the first call of a layout runs the checked op and binds the
launch it ran, with the tensors' addresses as the arguments that change; a later call of that
layout writes its own addresses and launches. What a layout does not say is whether the tensors
overlap: a model's own tensors are distinct allocations (as `paged.kernels.fused_calls` relies on),
and a call whose tensors share a start goes to the checked op. A launch whose tensors are not all
among its arguments (an input the op copied first) is never bound. Outputs are allocated as the
checked ops allocate them, so the same kernels write the same bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from paged.kernels.backends.launch_api import VECTOR_BYTES, pointer_slots
from paged.kernels.backends.layer_plans import FusedLayerOpsMixin, Ran

# Layouts kept per ops object; past it the table starts again (a model has a few per step size).
MAX_LAYOUTS = 4096

Bound = Callable[[Sequence[int]], None]


def _layout(t: object) -> tuple[Any, ...] | None:
    """None for what is not a tensor: no launch is bound for it, and the checked op names it."""
    if not isinstance(t, torch.Tensor):
        return None
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % VECTOR_BYTES == 0


def _bind(ran: Ran | None, roles: Sequence[torch.Tensor]) -> Bound | None:
    """`ran`'s launch bound with `roles`' addresses as its changing arguments, or None where a role's
    address is not among them (or two roles share one)."""
    slots = None if ran is None else pointer_slots([ran.launch], [t.data_ptr() for t in roles])
    if slots is None:
        return None
    return ran.runner.bind([(ran.unit, ran.launch, slots[0])])


class BoundLayerOps:
    """`backend`'s fused layer ops, each layout's launch bound at its first call."""

    def __init__(self, backend: FusedLayerOpsMixin) -> None:
        self.backend = backend
        self._bound: dict[tuple[Any, ...], Bound | None] = {}

    def _launch(self, key: tuple[Any, ...], roles: Sequence[torch.Tensor]) -> bool:
        """Runs `key`'s bound launch over `roles`; False where there is none or the roles share a start."""
        bound = self._bound.get(key)
        if bound is None:
            return False
        addresses = [t.data_ptr() for t in roles]
        if len(set(addresses)) != len(addresses):
            return False
        bound(addresses)
        return True

    def _keep(self, key: tuple[Any, ...], ran: Ran | None, roles: Sequence[torch.Tensor]) -> None:
        if key in self._bound:  # none bound for it, or roles sharing a start: the checked op serves it
            return
        if len(self._bound) >= MAX_LAYOUTS:
            self._bound.clear()
        self._bound[key] = _bind(ran, roles)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        key = ("rms_norm", eps, _layout(x), _layout(weight))
        out = torch.empty_like(x, memory_format=torch.contiguous_format)  # as the checked op's, for less host
        if self._launch(key, (out, x, weight)):
            return out
        out, ran = self.backend.rms_norm_ran(x, weight, eps)
        self._keep(key, ran, (out, x, weight))
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        key = ("add_rms_norm", eps, _layout(x), _layout(residual), _layout(weight))
        if self._launch(key, (x, residual, weight)):
            return x
        out, ran = self.backend.add_rms_norm_ran(x, residual, weight, eps)
        self._keep(key, ran, (x, residual, weight))
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        key = ("silu_and_mul", _layout(x))
        if x.dim() == 2 and x.shape[1] % 2 == 0:
            out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
            if self._launch(key, (out, x)):
                return out
        out, ran = self.backend.silu_and_mul_ran(x)
        self._keep(key, ran, (out, x))
        return out

    def rotary_embedding(self, qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         num_heads: int, head_dim: int) -> None:
        key = ("rotary_embedding", num_heads, head_dim, _layout(qk), _layout(positions), _layout(cos), _layout(sin))
        if self._launch(key, (qk, positions, cos, sin)):
            return
        _, ran = self.backend.rotary_embedding_ran(qk, positions, cos, sin, num_heads, head_dim)
        self._keep(key, ran, (qk, positions, cos, sin))
