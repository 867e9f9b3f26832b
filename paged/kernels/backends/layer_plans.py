"""Launch plans of the fused layer ops of kernels_cu/layer_ops.cuh (RMSNorm, residual add + RMSNorm,
SiLU-and-mul, RoPE) for the backends whose runner executes `Launch`es (cuda, emu).

Each op is one launch with a CTA per row (token). The plans read only shapes, strides, dtypes and
addresses, never a tensor's values, and allocate outputs with `torch.empty`, so a CUDA graph can
capture them. The kernels' exactness against the torch formulas is stated in layer_ops.cuh:
residual add and RoPE bit-identical, RMSNorm's sum of squares in a block-reduction order, SiLU with
CUDA's expf.

Tensors have contiguous columns and rows at any stride (the model passes views of fused
projections); anything else raises `ValueError` naming the argument and what is allowed.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import NamedTuple

import numpy as np
import torch

from paged.kernels.backends.launch_api import VECTOR_BYTES, Launch, Ptr, Runner
from paged.kernels.input_checks import check_disjoint
from paged.kernels.toolchain.specs import CXX_TYPES, Unit, layer_kernel, layer_unit

WARP_SIZE = 32
# One CTA covers a row: up to 1024 threads for the norms and SwiGLU (a 16-byte vector each per
# pass for hidden sizes up to 8192 in fp16), vLLM's 512 for RoPE's pairs.
MAX_ROW_THREADS = 1024
MAX_ROPE_THREADS = 512
INT32_MAX = 2**31 - 1
DTYPES = tuple(CXX_TYPES)


def _threads(work: int, limit: int) -> int:
    """Whole warps, one thread per work item up to `limit` (the kernels reduce over whole warps)."""
    return min(max(-(-work // WARP_SIZE), 1) * WARP_SIZE, limit)


def _require_int32(name: str, value: int) -> None:
    """The kernels take sizes and row strides as int (they index in int64 from there)."""
    if value > INT32_MAX:
        raise ValueError(f"{name}={value} exceeds the kernels' int32 range (at most {INT32_MAX})")


def _ptr(t: torch.Tensor) -> Ptr:
    return Ptr(t.data_ptr())


class Ran(NamedTuple):
    """The launch an op ran, with its runner and unit."""

    runner: Runner
    unit: Unit
    launch: Launch


class FusedLayerOpsMixin:
    """The fused layer ops of a runner backend; `paged.model.layer_ops.RunnerLayerOps` calls them.
    Outputs are new contiguous tensors except where an op works in place (named in its docstring)."""

    device_type: str | None

    @abstractmethod
    def runner(self, tensor: torch.Tensor) -> Runner:
        """The runner owning `tensor`'s device."""

    def _check(self, name: str, t: object, like: torch.Tensor | None = None) -> torch.Tensor:
        """A tensor of a served dtype on this backend's device type (and `like`'s dtype and device)."""
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if self.device_type is not None and t.device.type != self.device_type:
            raise ValueError(f"{name} must be on a {self.device_type} device for this backend, got {t.device}")
        if like is not None and (t.dtype != like.dtype or t.device != like.device):
            raise ValueError(f"{name} must be {like.dtype} on {like.device} like the activations, got {t.dtype} "
                             f"on {t.device}")
        return t

    def _rows(self, name: str, t: object, cols: int | None = None, like: torch.Tensor | None = None,
              written: bool = False) -> torch.Tensor:
        """`[T, cols]` with contiguous columns and an int32 row stride; a written one's rows must not overlap."""
        t = self._check(name, t, like)
        if t.dim() != 2 or (cols is not None and t.shape[1] != cols):
            want = f"[T, {cols}]" if cols is not None else "2-d [T, H]"
            raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} must have contiguous columns (stride 1), got strides {t.stride()}")
        if written and t.shape[0] > 1 and t.stride(0) < t.shape[1]:
            raise ValueError(f"{name} rows overlap (row stride {t.stride(0)} < {t.shape[1]} columns)")
        _require_int32(f"{name} row stride", t.stride(0))
        _require_int32(f"{name} width", t.shape[1])
        return t

    def _weight(self, weight: object, x: torch.Tensor) -> torch.Tensor:
        weight = self._check("weight", weight, like=x)
        if weight.dim() != 1 or weight.shape[0] != x.shape[1] or not weight.is_contiguous():
            raise ValueError(f"weight must be a contiguous [{x.shape[1]}] tensor, got shape {tuple(weight.shape)} "
                             f"strides {weight.stride()}")
        return weight

    def _run(self, t: torch.Tensor, op: str, vectorized: bool, grid_rows: int, threads: int,
             args: tuple[Ptr | np.int32 | np.float32, ...]) -> Ran:
        unit = layer_unit(t.dtype)
        kernel = layer_kernel(unit.dtype, op, vectorized)
        ran = Ran(self.runner(t), unit, Launch(kernel, (grid_rows, 1, 1), threads, 0, args))
        ran.runner.run(unit, [ran.launch])
        return ran

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`weight * F.rms_norm(x.float(), (H,), eps=eps).to(x.dtype)` for x `[T, H]`, as a new tensor."""
        return self.rms_norm_ran(x, weight, eps)[0]

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """In one pass per row: `residual += x` in place (rounded to the dtype), then
        `x = weight * rms_norm(residual)` in place; returns `x`."""
        return self.add_rms_norm_ran(x, residual, weight, eps)[0]

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`F.silu(x[:, :I]) * x[:, I:]` for x `[T, 2I]` (the fused gate/up output), as a new `[T, I]` tensor."""
        return self.silu_and_mul_ran(x)[0]

    def rotary_embedding(self, qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         num_heads: int, head_dim: int) -> None:
        """Rotates in place the first `num_heads` heads of `head_dim` of each row of `qk` (`[T, >=
        num_heads * head_dim]`, e.g. the fused qkv output: q and k heads together), HF's rotate_half
        layout: `x * cos + rotate_half(x) * sin` with the `[P, head_dim]` tables' rows at `positions`
        (int64 `[T]`). Positions are not read on the host: each must lie in `[0, P)`."""
        self.rotary_embedding_ran(qk, positions, cos, sin, num_heads, head_dim)

    # Each op as the public one above, and the launch it ran (None where it had no rows), which a
    # caller repeating the op over tensors laid out alike may bind (`paged.model.layer_ops`).

    def rms_norm_ran(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, Ran | None]:
        x = self._rows("x", x)
        weight, eps = self._weight(weight, x), _eps(eps)
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if x.numel() == 0:
            return out, None
        vectorized = _vectors_fit(x.shape[1], x, out) and _aligned(weight)
        args = (_ptr(out), _ptr(x), _ptr(weight), np.int32(out.stride(0)), np.int32(x.stride(0)), np.int32(x.shape[1]),
                np.float32(eps))
        return out, self._run(x, "rms_norm", vectorized, x.shape[0], _row_threads(x, x.shape[1], vectorized), args)

    def add_rms_norm_ran(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, Ran | None]:
        x = self._rows("x", x, written=True)
        residual = self._rows("residual", residual, x.shape[1], like=x, written=True)
        if residual.shape[0] != x.shape[0]:
            raise ValueError(f"residual must be {list(x.shape)} like x, got shape {tuple(residual.shape)}")
        weight, eps = self._weight(weight, x), _eps(eps)
        if x.numel() == 0:
            return x, None
        check_disjoint(("x", x), ("residual", residual), ("weight", weight))
        vectorized = _vectors_fit(x.shape[1], x, residual) and _aligned(weight)
        args = (_ptr(x), _ptr(residual), _ptr(weight), np.int32(x.stride(0)), np.int32(residual.stride(0)),
                np.int32(x.shape[1]), np.float32(eps))
        return x, self._run(x, "add_rms_norm", vectorized, x.shape[0], _row_threads(x, x.shape[1], vectorized), args)

    def silu_and_mul_ran(self, x: torch.Tensor) -> tuple[torch.Tensor, Ran | None]:
        x = self._rows("x", x)
        if x.shape[1] % 2 or x.shape[1] == 0:
            raise ValueError(f"x must be [T, 2 * intermediate], got shape {tuple(x.shape)} (odd or zero width)")
        inter = x.shape[1] // 2
        out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
        if x.shape[0] == 0:
            return out, None
        # The up half starts `inter` elements into each row: vectors fit it when they fit `inter`.
        vectorized = _vectors_fit(inter, x, out)
        args = (_ptr(out), _ptr(x), np.int32(out.stride(0)), np.int32(x.stride(0)), np.int32(inter))
        return out, self._run(x, "silu_and_mul", vectorized, x.shape[0], _row_threads(x, inter, vectorized), args)

    def rotary_embedding_ran(self, qk: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             num_heads: int, head_dim: int) -> tuple[None, Ran | None]:
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
        qk = self._rows("qk", qk)  # only the rotated columns are written: checked for overlap below
        width = num_heads * head_dim
        if qk.shape[1] < width:
            raise ValueError(f"qk must be [T, >= {width}] (num_heads * head_dim), got shape {tuple(qk.shape)}")
        if qk.shape[0] > 1 and qk.stride(0) < width:
            raise ValueError(f"qk rows overlap (row stride {qk.stride(0)} < {width} rotated columns)")
        if not isinstance(positions, torch.Tensor) or positions.dtype != torch.int64 or positions.dim() != 1:
            got = f"{positions.dim()}-d {positions.dtype}" if isinstance(positions, torch.Tensor) else type(positions)
            raise ValueError(f"positions must be a 1-d int64 tensor, got {got}")
        if positions.shape[0] != qk.shape[0] or positions.device != qk.device:
            raise ValueError(f"positions must be [{qk.shape[0]}] on {qk.device}, got {tuple(positions.shape)} on "
                             f"{positions.device}")
        cos, sin = self._check("cos", cos, like=qk), self._check("sin", sin, like=qk)
        if cos.dim() != 2 or cos.shape[1] != head_dim or not cos.is_contiguous():
            raise ValueError(f"cos must be a contiguous [P, {head_dim}] table, got shape {tuple(cos.shape)} strides "
                             f"{cos.stride()}")
        if sin.shape != cos.shape or not sin.is_contiguous():
            raise ValueError(f"sin must be a contiguous {list(cos.shape)} table like cos, got shape "
                             f"{tuple(sin.shape)} strides {sin.stride()}")
        if qk.shape[0] == 0:
            return None, None
        check_disjoint(("qk", qk[:, :width]), ("cos", cos), ("sin", sin), ("positions", positions))
        positions = positions.contiguous()
        args = (_ptr(qk), _ptr(positions), _ptr(cos), _ptr(sin), np.int32(qk.stride(0)), np.int32(num_heads),
                np.int32(head_dim))
        return None, self._run(qk, "rotary_embedding", False, qk.shape[0], _threads(width // 2, MAX_ROPE_THREADS),
                               args)


def _eps(eps: object) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a number >= 0, got {eps!r}")
    return float(eps)


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % VECTOR_BYTES == 0


def _vectors_fit(width: int, *rows: torch.Tensor) -> bool:
    """Whether rows of `width` elements of every `[T, *]` tensor can be read in 16-byte vectors:
    each tensor's start and row stride are multiples of 16 bytes, and so is `width`."""
    size = rows[0].element_size()
    return width * size % VECTOR_BYTES == 0 and all(
        _aligned(t) and t.stride(0) * size % VECTOR_BYTES == 0 for t in rows)


def _row_threads(x: torch.Tensor, width: int, vectorized: bool) -> int:
    """A thread per load of a row of `width` elements, up to `MAX_ROW_THREADS`."""
    return _threads(width * x.element_size() // VECTOR_BYTES if vectorized else width, MAX_ROW_THREADS)
