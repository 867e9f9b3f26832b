"""Greedy sampling's argmax over a step's logits rows (`paged.executor.step_sampling`).

torch's CPU argmax reads a decode step's fp32 logits (rows x a vocabulary of ~50K) at ~9 GB/s:
0.7 ms of a ~36 ms bf16 step of SmolLM2 at 32 rows. The native cpu kernel (kernels_cu/cpu/argmax.h)
returns what torch does (the first index of the largest value, or of the first NaN) from two
vectorised passes per row over the threads. Logits it does not serve (another device or dtype,
strided columns, an empty vocabulary) or a native library that cannot run here go to torch.
"""

from __future__ import annotations

import torch

from paged.kernels import fused_ops


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1, keepdim=True)` for 2-d logits `[rows, vocab]`."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or not logits.shape[1]
            or logits.stride(1) != 1 or fused_ops.unavailable_reason() is not None):
        return logits.argmax(dim=-1, keepdim=True)
    rows, cols = logits.shape
    out = torch.empty(rows, 1, dtype=torch.int64)
    # the layer ops' entry-point lookup, cached, and status check (`argmax_rows_cpu`)
    fused_ops.run("argmax_rows", torch.float32, out.data_ptr(), logits.data_ptr(), logits.stride(0), rows, cols,
                  torch.get_num_threads())
    return out
