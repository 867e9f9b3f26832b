"""A read-only bandwidth probe in Triton for experiments/gpu/kernel_timing.py: a persistent grid of a few
programs per SM streams an fp16 buffer once with wide loads and sums it in fp32, each program writing
one partial sum (a few KB written against a GiB read). Imported only where Triton is (CUDA machines).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

BLOCK = 8192  # elements per load: 16 KiB per program per step
PROGRAMS_PER_SM = 4


@triton.jit
def _read_kernel(x_ptr, partial_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, step):
        offsets = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offsets, mask=offsets < n, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def triton_read(buf: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A call that reads every element of the fp16 CUDA tensor `buf` once; checked against torch."""
    programs = torch.cuda.get_device_properties(buf.device).multi_processor_count * PROGRAMS_PER_SM
    partial = torch.empty(programs, dtype=torch.float32, device=buf.device)

    def call() -> torch.Tensor:
        _read_kernel[(programs,)](buf, partial, buf.numel(), BLOCK=BLOCK)
        return partial

    total = call().sum().item()
    expected = buf.sum(dtype=torch.float32).item()
    if abs(total - expected) > 1e-3 * abs(expected) + 1:
        raise ValueError(f"the Triton read probe summed {total}, torch {expected}: it does not read every byte")
    return call
