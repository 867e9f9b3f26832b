"""Linear layers whose weights are stored the way the device's GEMM reads them fastest.

On a CPU, torch's `F.linear` goes to MKL, which repacks the weight on every call; at decode batch
sizes (tens of rows) that repacking is most of the work and MKL reaches ~110 fp32 GFLOP/s on this
project's 2-core machine. oneDNN's matmul with the weight reordered once into its blocked layout
(the path inductor's weight prepacking uses) reaches ~190-200 GFLOP/s from 32 rows up, and 2.2x on
the 49K-row lm_head. The blocked layout is opaque, so a packed layer keeps no plain copy.
At decode sizes oneDNN still does not stream the weight at the memory's pace; paged's own packed
loop (`paged.kernels.packed_linear`, fp32 on AVX-512, bf16 on AVX512-BF16) does, and matches oneDNN
with many rows.

`model.gemm` picks the kernel: `torch` (F.linear everywhere), `onednn` (prepacked), `packed` (paged's
loop for the layers it tiles, oneDNN for the rest; refused where the CPU lacks the loop's
instructions) or `auto` (packed where it runs, else onednn for fp32 and for bf16 where the CPU has
AVX512 bf16, else torch). Where the CPU has AMX, oneDNN's bf16 GEMMs of many rows run on its tiles, so
a packed bf16 layer there takes only the calls of up to `AMX_LOOP_ROWS` rows and keeps oneDNN's copy
for the rest (unmeasured: no AMX machine yet). The kernels sum in different orders, so
their logits differ in the last bits; greedy outputs match vLLM's either way (docs/speed.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paged.config.choices import GEMMS
from paged.kernels import packed_linear
from paged.kernels.packed_linear import PackedLinear

# oneDNN picks its weight layout for an expected row count; decode batches are tens of rows, and the
# layout chosen for 64 also runs prefill's thousands of rows at full speed (measured: 194 GFLOP/s).
_ROWS_HINT = 64
_ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
# Where the CPU has AMX (oneDNN's bf16 GEMMs on its tiles), the most rows a packed bf16 layer keeps
# on the loop: a decode's few rows cost streaming the weight, which the loop does at the memory's
# pace. 4 is unmeasured (no AMX machine yet).
AMX_LOOP_ROWS = 4


def _has_amx() -> bool:
    return bool(torch.cpu._is_amx_tile_supported())


def _packed_rows(dtype: torch.dtype) -> int | None:
    """The row counts a packed layer takes: None for every call, else calls of up to this many rows."""
    return AMX_LOOP_ROWS if dtype == torch.bfloat16 and _has_amx() else None


def describe_gemm(gemm: str, dtype: torch.dtype) -> str:
    """`gemm` as the executor's description names it, with which calls the packed loop takes."""
    if gemm != "packed":
        return gemm
    rows = _packed_rows(dtype)
    calls = "every call" if rows is None else f"calls of up to {rows} rows"
    return f"packed (the AVX-512 loop, {calls} of the layers it tiles; oneDNN for the rest)"


def onednn_bf16_supported() -> bool:
    """oneDNN's bf16 matmul needs AVX512 bf16 (or AMX); without it a packed bf16 call fails at run time."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_unsupported_reason(dtype: torch.dtype, device: torch.device, gemm: str = "onednn") -> str | None:
    """Why prepacked oneDNN linears (what `gemm` needs) cannot run for this model, or None."""
    if device.type != "cpu":
        return f"model.gemm={gemm} runs on a CPU, not on {device}"
    if dtype not in _ONEDNN_DTYPES:
        return f"model.gemm={gemm} supports float32 and bfloat16 models, not {dtype}"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return f"model.gemm={gemm} needs a torch build with oneDNN (mkldnn)"
    if dtype == torch.bfloat16 and not onednn_bf16_supported():
        return f"model.gemm={gemm} runs bfloat16 only on a CPU with AVX512 bf16 support; this one has none"
    return None


def packed_unsupported_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why `model.gemm=packed` cannot run for this model (its loop, or the oneDNN it leaves the rest to)."""
    reason = onednn_unsupported_reason(dtype, device, "packed")
    if reason is None and (loop := packed_linear.unavailable_reason(dtype)) is not None:
        reason = f"model.gemm=packed cannot run {dtype} here: {loop}"
    return reason


def resolve_gemm(gemm: str, dtype: torch.dtype, device: torch.device) -> str:
    """The kernel `model.gemm` resolves to: `torch`, `onednn` or `packed`."""
    if gemm not in GEMMS:
        raise ValueError(f"model.gemm={gemm!r} is not supported; allowed: {', '.join(GEMMS)}")
    reasons = {"packed": packed_unsupported_reason, "onednn": onednn_unsupported_reason}
    if gemm in reasons and (reason := reasons[gemm](dtype, device)):
        raise ValueError(reason)
    if gemm == "auto":  # the first that runs; the native library is only built when it is asked about
        return next((kind for kind, why in reasons.items() if why(dtype, device) is None), "torch")
    return gemm


class Linear:
    """`y = x @ weight.T + bias` for a `[out, in]` weight, with the kernel `resolve_gemm` chose."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemm: str) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.loop = PackedLinear(weight) if gemm == "packed" and packed_linear.serves(weight, bias) else None
        self.loop_rows = _packed_rows(weight.dtype) if self.loop is not None else None  # None: every call
        self.packed = gemm in ("onednn", "packed") and (self.loop is None or self.loop_rows is not None)
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, _ROWS_HINT)
        else:  # F.linear's plain weight, or none where the loop takes every call (one copy: the loop's)
            self.weight = None if self.loop is not None else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.loop is not None and (self.loop_rows is None or (x.dim() == 2 and x.shape[0] <= self.loop_rows)):
            # the model's activations are in the weight's dtype, so only the shape needs making right
            rows = x.reshape(-1, self.in_features)
            rows = rows if rows.stride(1) == 1 else rows.contiguous()
            return self.loop.run(rows).view(*x.shape[:-1], self.out_features)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
