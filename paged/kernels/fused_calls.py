"""The fused layer ops as a model's forward calls them: a few µs of host per call instead of ~12.

`paged.kernels.fused_ops` checks every argument of every call (types, shapes, strides, overlap), which
costs ~12 µs of Python per call; a decode step of a 30-layer model makes 120 of them, over tens of
rows that the kernels need 2-8 µs for. A model's own tensors are laid out by construction: the
activations are fresh contiguous outputs of its matmuls, the weights and RoPE tables contiguous
parameters of its dtype, the positions the executor's int64 vector. So each function here checks
only what that layout promises and the kernels rely on (dtype, contiguity, matching widths), runs
the entry point directly on what passed, and hands anything else to the checked function of
`fused_ops`, which serves it or raises naming the bad argument. Position ranges are checked by the
kernel itself (a refusal raises). Results are those of `fused_ops`: the same kernels run.
"""

from __future__ import annotations

import torch

from paged.kernels import fused_ops


def _plain(t: torch.Tensor, dtype: torch.dtype, dim: int) -> bool:
    """A contiguous cpu tensor of `dtype` with `dim` dimensions."""
    return t.dtype == dtype and t.dim() == dim and t.is_contiguous() and t.device.type == "cpu"


def _norm_weight(weight: torch.Tensor, x: torch.Tensor) -> bool:
    return _plain(weight, x.dtype, 1) and weight.shape[0] == x.shape[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`fused_ops.rms_norm(x, weight, eps)` into a new tensor."""
    if not (x.dtype in fused_ops.DTYPES and _plain(x, x.dtype, 2) and _norm_weight(weight, x) and x.numel()):
        return fused_ops.rms_norm(x, weight, eps)
    out = torch.empty_like(x)
    rows, hidden = x.shape
    fused_ops.run("rms_norm", x.dtype, out.data_ptr(), hidden, x.data_ptr(), hidden, weight.data_ptr(), rows,
                  hidden, float(eps), torch.get_num_threads())
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`fused_ops.add_rms_norm(x, residual, weight, eps)`: `residual += x`, then its norm over `x`."""
    fast = (x.dtype in fused_ops.DTYPES and _plain(x, x.dtype, 2) and _plain(residual, x.dtype, 2)
            and residual.shape == x.shape and _norm_weight(weight, x) and x.numel()
            and residual.data_ptr() != x.data_ptr())
    if not fast:
        return fused_ops.add_rms_norm(x, residual, weight, eps)
    rows, hidden = x.shape
    fused_ops.run("add_rms_norm", x.dtype, x.data_ptr(), hidden, residual.data_ptr(), hidden, weight.data_ptr(),
                  rows, hidden, float(eps), torch.get_num_threads())
    return x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`fused_ops.silu_and_mul(x)` into a new tensor."""
    if not (x.dtype in fused_ops.DTYPES and _plain(x, x.dtype, 2) and x.shape[1] % 2 == 0 and x.numel()):
        return fused_ops.silu_and_mul(x)
    rows, width = x.shape
    inter = width // 2
    out = torch.empty(rows, inter, dtype=x.dtype)
    fused_ops.run("silu_and_mul", x.dtype, out.data_ptr(), inter, x.data_ptr(), width, rows, inter,
                  *fused_ops.silu_lanes(x.dtype), torch.get_num_threads())
    return out


def rotary_embedding(
    qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int
) -> None:
    """`fused_ops.rotary_embedding(...)`: the first `num_heads` heads of every row of `qk` rotated in place."""
    width = num_heads * head_dim
    fast = (qk.dtype in fused_ops.DTYPES and qk.dim() == 2 and qk.device.type == "cpu" and qk.stride(1) == 1
            and qk.shape[1] >= width and qk.stride(0) >= width and qk.shape[0]
            and _plain(positions, torch.int64, 1) and positions.shape[0] == qk.shape[0]
            and _plain(cos, qk.dtype, 2) and _plain(sin, qk.dtype, 2) and cos.shape == sin.shape
            and cos.shape[1] == head_dim and head_dim % 2 == 0)
    if not fast:
        fused_ops.rotary_embedding(qk, positions, cos, sin, num_heads, head_dim)
        return
    fused_ops.run("rotary_embedding", qk.dtype, qk.data_ptr(), qk.stride(0), positions.data_ptr(), cos.data_ptr(),
                  sin.data_ptr(), qk.shape[0], cos.shape[0], num_heads, head_dim, torch.get_num_threads())
