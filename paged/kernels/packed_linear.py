"""A linear layer with its weight packed once for paged's AVX-512 loop (kernels_cu/cpu/gemm_packed.h):
fp32 on AVX-512, bf16 on AVX512-BF16.

With a few rows (a decode step's) a linear layer is bound by streaming its weight, and oneDNN's
small-M matmul does not stream it at the memory's pace: on a 2-core AVX512-BF16 EPYC SmolLM2-135M's
120 layer calls of a step took ~20 ms in bf16 (~11 GB/s of weights) and 18-22 ms in fp32 at 1-8 rows.
This loop keeps 6 rows x 64 outputs of fp32 sums in registers and reads each weight once per 6 rows:
fp32 11.1 ms a step at 1 and 4 rows, 13.7 at 8 (oneDNN 17.8-22.4), 22.3 at 16 (27.9), 39.7 at 32
(44.9), 71.7 at 64 (85.6), level at 512 (both compute-bound); bf16 ~11 ms at 1 row on one core,
~7.5 on two. Numbers and commands: docs/speed.md#issue-47.

Threads: every call runs on `torch.get_num_threads()` threads. Under `OMP_WAIT_POLICY=PASSIVE` a bf16
call of up to 4 rows stayed on the calling thread (a woken worker cost more than it streamed); with
paged's short spin (`paged.utils.threads`) the worker is mostly awake between a step's calls, and two
threads stream a one-row bf16 step's weights in ~7.5 ms against ~11 on one: one request's bf16 decode
went from 45-46 to 51-52 output tok/s, with gemm_packed.h's prefetch of the next panel in the same
change. How the threads share a call (output tiles for a decode's rows, rows for a prefill's) is
gemm_packed.h's.

`PackedLinear(weight)` packs a `[out, in]` fp32 or bf16 weight once; calling it with `x` `[rows, in]`
(contiguous columns, the weight's dtype) returns `x @ weight.T`, the sums in fp32 in the order of the
inputs (bf16: rounded once, as a bf16 GEMM does; oneDNN's to the bit at 1 and 3 rows in a check). Where
it runs instead of oneDNN is `paged.model.linear`'s choice (`model.gemm`).
"""

from __future__ import annotations

from functools import cache
from typing import NamedTuple

import torch

from paged.kernels.backends import cpu as _cpu

# out_features must fill whole blocks of 16 outputs (a layer's last tile of 4 may hold fewer); bf16's
# in_features whole pairs.
OUT_MULTIPLE = 16


class _Kind(NamedTuple):
    code: int  # gemm_packed.h's kind
    in_multiple: int  # inputs per instruction and output
    needs: str  # the instructions the build must have


_KINDS = {torch.float32: _Kind(0, 1, "AVX-512"), torch.bfloat16: _Kind(1, 2, "AVX512-BF16")}


@cache
def unavailable_reason(dtype: torch.dtype) -> str | None:
    """Why the packed loop cannot run `dtype` layers in this process; None when it can."""
    if dtype not in _KINDS:
        return f"the packed linear runs float32 and bfloat16 layers, not {dtype}"
    reason = _cpu._load_failure()
    if reason is not None:
        return f"the native cpu library is unavailable: {reason}"
    if not _cpu.load().gemm_packed_lanes_cpu(_KINDS[dtype].code):
        return f"the native cpu library was built for a CPU without {_KINDS[dtype].needs}"
    return None


def serves(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `PackedLinear` takes this layer: an fp32 or bf16 `[out, in]` cpu weight of whole tiles, no
    bias, on a CPU (and build) that runs its dtype."""
    return (bias is None and weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype in _KINDS
            and weight.shape[0] % OUT_MULTIPLE == 0 and weight.shape[1] % _KINDS[weight.dtype].in_multiple == 0
            and unavailable_reason(weight.dtype) is None)


class PackedLinear:
    """An fp32 or bf16 weight packed for gemm_packed.h's loop."""

    def __init__(self, weight: torch.Tensor) -> None:
        if not serves(weight, None):
            in_multiple = _KINDS[weight.dtype].in_multiple if weight.dtype in _KINDS else 1
            raise ValueError(f"the packed linear takes a float32 or bfloat16 [out, in] cpu weight with out a "
                             f"multiple of {OUT_MULTIPLE} and in of {in_multiple}, on a CPU that runs its dtype "
                             f"({unavailable_reason(weight.dtype) or 'this one does'}), got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.dtype = weight.dtype
        self.out_features, self.in_features = weight.shape
        self._kind = _KINDS[self.dtype]
        weight = weight.contiguous()
        self.packed = torch.empty_like(weight)
        lib = _cpu.load()
        _cpu.check_status("gemm_pack_cpu", lib.gemm_pack_cpu(self._kind.code, weight.data_ptr(), self.out_features,
                                                             self.in_features, self.packed.data_ptr()))
        self._linear = lib.gemm_packed_cpu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T` for `x` `[rows, in]` in the weight's dtype with contiguous columns, as a new
        `[rows, out]` tensor."""
        if x.dtype != self.dtype or x.dim() != 2 or x.shape[1] != self.in_features or x.stride(1) != 1:
            raise ValueError(f"x must be {self.dtype} [rows, {self.in_features}] with contiguous columns, got "
                             f"{x.dtype} {tuple(x.shape)} strides {x.stride()}")
        return self.run(x)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """`__call__` without its checks, for a caller that already holds `x` as it requires (a model's
        `Linear`, once per layer call)."""
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=self.dtype)
        status = self._linear(self._kind.code, y.data_ptr(), self.out_features, x.data_ptr(), x.stride(0),
                              self.packed.data_ptr(), rows, self.out_features, self.in_features,
                              torch.get_num_threads())
        _cpu.check_status("gemm_packed_cpu", status)
        return y
