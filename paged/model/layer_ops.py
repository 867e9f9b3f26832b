"""The decoder's elementwise ops, as torch formulas or as a kernel backend's fused kernels.

A prefill step of a few thousand tokens spent a quarter of its time outside the matmuls on this
2-core machine: every torch op of RMSNorm, RoPE and SwiGLU reads and writes the whole activation,
and the activations do not fit in cache. The native ops make one pass each, fuse the residual add
into the norm and rotate q and k in place. They keep torch's fp32 arithmetic, to the bit on x86
(RMSNorm copies the summation order of torch's sum kernel, SiLU its vector `exp`; RoPE is built
without FMA contraction), so greedy outputs stay those of the torch formulas. A bf16 model
(`model.dtype=bfloat16`) runs them too: they compute in fp32 and round to bf16 after each op as
the torch formulas do in bf16, to the bit, in one pass where torch makes several.

On the cuda and emu backends the same ops are the CUDA kernels of kernels_cu/layer_ops.cuh
(`RunnerLayerOps`): one launch each where the torch formulas run 2 (SwiGLU) to 9 (fp16 add +
RMSNorm) ATen kernels. The residual add and RoPE are bit-identical to the torch formulas; RMSNorm
sums its squares in a block reduction's order and SiLU uses CUDA's expf (kernels_cu/layer_ops.cuh
states what that changes).

The executor picks the ops from its attention backend (`layer_ops_for`): the native ones on the
native cpu backend (`kernel.backend=cpu`, or `auto` on a CPU), the CUDA kernels on a runner backend
(cuda, emu), the torch formulas everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged.kernels import fused_calls as native
from paged.kernels.backends.interface import KernelBackend
from paged.kernels.backends.layer_plans import FusedLayerOpsMixin
from paged.kernels.bound_calls import BoundLayerOps
from paged.kernels.fused_ops import DTYPES as NATIVE_DTYPES

# per step, what `rope` needs for its positions (see `TorchLayerOps.rotation`)
Rotation = tuple[torch.Tensor, ...]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate_half convention: dimension i pairs with i + head_dim / 2."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchLayerOps:
    """The reference formulas, for any device and dtype (HF's RMSNorm normalises in fp32)."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`residual += x` in place, then the norm of the sum."""
        return self.rms_norm(residual.add_(x), weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotation(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Rotation:
        """What `rope` needs for a step's `positions`, computed once per forward for every layer:
        here the cos/sin rows, gathered and shaped to broadcast over heads."""
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def rope(self, qkv: torch.Tensor, rotation: Rotation, num_heads: int, head_dim: int) -> torch.Tensor:
        """The first `num_heads` heads of each `qkv` row rotated, as `[T, num_heads, head_dim]`
        (q and k together: one set of ops instead of two)."""
        qk = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
        return apply_rope(qk, *rotation)


class NativeCpuLayerOps(TorchLayerOps):
    """The cpu backend's fused kernels for fp32 and bf16 CPU tensors (`NATIVE_DTYPES`), called the
    lean way a forward's own tensors allow (`paged.kernels.fused_calls`); other dtypes take the torch
    formulas."""

    name = "native"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype not in NATIVE_DTYPES:
            return super().rms_norm(x, weight, eps)
        return native.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype not in NATIVE_DTYPES:
            return super().add_rms_norm(x, residual, weight, eps)
        return native.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in NATIVE_DTYPES:
            return super().silu_and_mul(x)
        return native.silu_and_mul(x)

    def rotation(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Rotation:
        """The positions and the whole tables: the kernel looks the rows up itself."""
        if cos.dtype not in NATIVE_DTYPES:
            return super().rotation(positions, cos, sin)
        return positions, cos, sin

    def rope(self, qkv: torch.Tensor, rotation: Rotation, num_heads: int, head_dim: int) -> torch.Tensor:
        """Rotates `qkv`'s first heads in place (no copy of q or k) and returns them as a view."""
        if qkv.dtype not in NATIVE_DTYPES:
            return super().rope(qkv, rotation, num_heads, head_dim)
        native.rotary_embedding(qkv, *rotation, num_heads, head_dim)
        return qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)


class RunnerLayerOps(TorchLayerOps):
    """The CUDA kernels of kernels_cu/layer_ops.cuh through a runner backend (cuda, emu), for every
    model dtype, each layout's launch bound at its first call (`paged.kernels.bound_calls`). The
    norms write in place where the native cpu ops do; nothing reads a tensor's values on the host,
    so a CUDA graph can capture a step."""

    name = "fused"

    def __init__(self, backend: FusedLayerOpsMixin) -> None:
        self.backend = backend
        self.bound = BoundLayerOps(backend)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.bound.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """`residual += x` in place, then the norm of the sum written over `x`, which is returned."""
        return self.bound.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return self.bound.silu_and_mul(x)

    def rotation(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Rotation:
        """The positions and the whole tables: the kernel looks the rows up itself."""
        return positions, cos, sin

    def rope(self, qkv: torch.Tensor, rotation: Rotation, num_heads: int, head_dim: int) -> torch.Tensor:
        """Rotates `qkv`'s first heads in place (no copy of q or k) and returns them as a view."""
        self.bound.rotary_embedding(qkv, *rotation, num_heads, head_dim)
        return qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)


TORCH_OPS = TorchLayerOps()
NATIVE_CPU_OPS = NativeCpuLayerOps()


def layer_ops_for(backend: KernelBackend) -> TorchLayerOps:
    """The ops a Llama layer runs beside attention on `backend`: the native fused ones wherever
    attention runs natively on the CPU, the CUDA kernels on a runner backend (cuda, emu), the torch
    formulas everywhere else (module docstring)."""
    if backend.name == "cpu":
        return NATIVE_CPU_OPS
    if isinstance(backend, FusedLayerOpsMixin):
        return RunnerLayerOps(backend)
    return TORCH_OPS
