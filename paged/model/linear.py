"""Linear layers whose weights are stored the way the device's GEMM reads them fastest.

On a CPU, torch's `F.linear` goes to MKL, which repacks the weight on every call; at decode batch
sizes (tens of rows) that repacking is most of the work and MKL reaches ~110 fp32 GFLOP/s on this
project's 2-core machine. oneDNN's matmul with the weight reordered once into its blocked layout
(the path inductor's weight prepacking uses) reaches ~190-200 GFLOP/s from 32 rows up, and 2.2x on
the 49K-row lm_head. The blocked layout is opaque, so a packed layer keeps no plain copy.

`model.gemm` picks the kernel: `torch` (F.linear everywhere), `onednn` (prepacked; refused where
oneDNN cannot run) or `auto` (onednn for fp32 models on a CPU with oneDNN, and for bf16 ones where the
CPU has AVX512 bf16; torch otherwise).
The two kernels sum in different orders, so their logits differ in the last bits; greedy outputs
match vLLM's either way (docs/speed.md).

A bf16 layer that `onednn` serves on a CPU with AVX512-BF16 runs `paged.kernels.bf16_linear`'s loop
instead (its own packed copy of the weight): every call where the CPU has no AMX, the calls of a
few rows (a decode step's) where it has, oneDNN's copy then serving the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged.config.choices import GEMMS
from paged.kernels import bf16_linear
from paged.kernels.bf16_linear import PackedBf16

# oneDNN picks its weight layout for an expected row count; decode batches are tens of rows, and the
# layout chosen for 64 also runs prefill's thousands of rows at full speed (measured: 194 GFLOP/s).
_ROWS_HINT = 64
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def _has_amx() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


def describe_gemm(gemm: str, dtype: torch.dtype) -> str:
    """`gemm` as the executor's description names it, with where bf16 layers run the packed loop."""
    if gemm != "onednn" or dtype != torch.bfloat16 or bf16_linear.unavailable_reason() is not None:
        return gemm
    rows = f", calls of up to {bf16_linear.ONE_CORE_ROWS} rows" if _has_amx() else ""
    return f"{gemm} (the AVX512-BF16 loop for the bf16 layers it tiles{rows})"


def onednn_bf16_supported() -> bool:
    """oneDNN's bf16 matmul needs AVX512 bf16 (or AMX); without it a packed bf16 call fails at run time."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_unsupported_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why prepacked oneDNN linears cannot run for this model, or None."""
    if device.type != "cpu":
        return f"model.gemm=onednn runs on a CPU, not on {device}"
    if dtype not in _ONEDNN_DTYPES:
        return f"model.gemm=onednn supports float32 and bfloat16 models, not {dtype}"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "model.gemm=onednn needs a torch build with oneDNN (mkldnn)"
    if dtype == torch.bfloat16 and not onednn_bf16_supported():
        return "model.gemm=onednn runs bfloat16 only on a CPU with AVX512 bf16 support; this one has none"
    return None


def resolve_gemm(gemm: str, dtype: torch.dtype, device: torch.device) -> str:
    """The kernel `model.gemm` resolves to: `torch` or `onednn`."""
    if gemm not in GEMMS:
        raise ValueError(f"model.gemm={gemm!r} is not supported; allowed: {', '.join(GEMMS)}")
    reason = onednn_unsupported_reason(dtype, device)
    if gemm == "onednn" and reason:
        raise ValueError(reason)
    if gemm == "auto":
        return "torch" if reason else "onednn"
    return gemm


class Linear:
    """`y = x @ weight.T + bias` for a `[out, in]` weight, with the kernel `resolve_gemm` chose."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemm: str) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = gemm == "onednn"
        # a bf16 layer on AVX512-BF16 (paged.kernels.bf16_linear): every call, or, where AMX makes
        # oneDNN's large-row GEMMs faster, the calls of a few rows, the layer keeping oneDNN's copy too
        self.bf16 = PackedBf16(weight) if self.packed and bf16_linear.serves(weight, bias) else None
        self.bf16_rows = bf16_linear.ONE_CORE_ROWS if _has_amx() else None  # None: every call
        if self.bf16 is not None and self.bf16_rows is None:
            self.packed, self.weight = False, None  # one copy of the weight: the packed one
        else:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16 is not None and (self.bf16_rows is None or (x.dim() == 2 and x.shape[0] <= self.bf16_rows)):
            rows = x.reshape(-1, self.in_features)
            return self.bf16(rows if rows.stride(1) == 1 else rows.contiguous()).view(*x.shape[:-1], self.out_features)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
