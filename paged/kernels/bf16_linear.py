"""A bf16 linear layer on a CPU with AVX512-BF16 (kernels_cu/cpu/gemm_bf16.h).

With a few rows (a decode step's) a linear layer is bound by streaming its weight. oneDNN's bf16
matmul splits each call over the OpenMP threads, which slept between calls under paged's wait policy
of the time (`OMP_WAIT_POLICY=PASSIVE`, fair to a busy neighbour), so every call paid their wake-up:
SmolLM2-135M's 120 layer calls of one row took ~20 ms a step (~11 GB/s of weights) on a 2-core
AVX512-BF16 EPYC. This loop on the calling thread streams ~19 GB/s on one core and wakes nobody:
~11 ms at one row, ~12 at four; from about six rows two threads win despite their wake-up (13.4 ms
at six rows against 14.6 on one, 18.2 against 25.8 at sixteen; oneDNN ~25). So up to
`ONE_CORE_ROWS` rows run on the calling thread, more over `torch.get_num_threads()` threads, where
its 4-row x 64-output tiles run at oneDNN's own AVX512-BF16 speed (~400 GFLOP/s there at 512 rows).
Under the short spin paged now asks for (`paged.utils.threads`) the worker is often still awake, and
two threads at every row count measured level with this limit end to end (1 request: 47.1 / 45.3
against 45.4 / 44.2 tok/s; 32: inside the noise); it stays for a run that sleeps at once.

`PackedBf16(weight)` packs a `[out, in]` bf16 weight once; calling it with `x` `[rows, in]`
(contiguous columns) returns `x @ weight.T` in bf16, the sums in fp32 rounded once, as a bf16 GEMM
does (oneDNN's to the bit at 1 and 3 rows in a check, one element in 7,680 an ulp apart at 8 rows:
the sums are ordered nearly alike). `paged.model.linear` uses it for every call of a bf16
layer where the CPU has no AMX, and for the calls of up to `ONE_CORE_ROWS` rows where it has (AMX
tiles make oneDNN's large-row GEMMs faster; that layer keeps oneDNN's copy of the weight too).
"""

from __future__ import annotations

from functools import cache

import torch

from paged.kernels.backends import cpu as _cpu

# Up to this many rows the loop on one core beats two woken threads (docs/speed.md: measured 4 against 8
# end to end, alternating: 4 won at 8 and 32 requests).
ONE_CORE_ROWS = 4
# out_features must fill whole tiles of 4 blocks of 16 outputs; in_features whole pairs.
OUT_MULTIPLE, IN_MULTIPLE = 64, 2


@cache
def unavailable_reason() -> str | None:
    """Why the packed bf16 layer cannot run in this process; None when it can."""
    reason = _cpu._load_failure()
    if reason is not None:
        return f"the native cpu library is unavailable: {reason}"
    if not _cpu.load().gemm_bf16_lanes_cpu():
        return "the native cpu library was built for a CPU without AVX512-BF16"
    return None


def serves(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `PackedBf16` takes this layer: a bf16 `[out, in]` cpu weight of whole tiles, no bias,
    on a CPU (and build) with AVX512-BF16."""
    return (bias is None and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % OUT_MULTIPLE == 0 and weight.shape[1] % IN_MULTIPLE == 0
            and unavailable_reason() is None)


class PackedBf16:
    """A bf16 weight packed for gemm_bf16.h's loop."""

    def __init__(self, weight: torch.Tensor) -> None:
        if not serves(weight, None):
            raise ValueError(f"the packed bf16 linear takes a bf16 [out, in] cpu weight with out a multiple of "
                             f"{OUT_MULTIPLE} and in of {IN_MULTIPLE} on a CPU with AVX512-BF16 "
                             f"({unavailable_reason() or 'this one has it'}), got {weight.dtype} "
                             f"{tuple(weight.shape)} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        weight = weight.contiguous()
        self.packed = torch.empty_like(weight)
        lib = _cpu.load()
        _cpu.check_status("gemm_bf16_pack_cpu", lib.gemm_bf16_pack_cpu(weight.data_ptr(), self.out_features,
                                                                       self.in_features, self.packed.data_ptr()))
        self._linear = lib.gemm_bf16_cpu

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ weight.T` for bf16 `x` `[rows, in]` with contiguous columns, as a new `[rows, out]`
        tensor: on the calling thread up to `ONE_CORE_ROWS` rows, else on torch's threads."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.in_features or x.stride(1) != 1:
            raise ValueError(f"x must be bf16 [rows, {self.in_features}] with contiguous columns, got {x.dtype} "
                             f"{tuple(x.shape)} strides {x.stride()}")
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.bfloat16)
        threads = 1 if rows <= ONE_CORE_ROWS else torch.get_num_threads()
        _cpu.check_status("gemm_bf16_cpu", self._linear(y.data_ptr(), self.out_features, x.data_ptr(), x.stride(0),
                                                        self.packed.data_ptr(), rows, self.out_features,
                                                        self.in_features, threads))
        return y
