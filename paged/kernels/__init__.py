"""Attention and cache ops over vLLM's paged KV cache, in three layers:

- the front end (`ops.py`, `validate.py`, `registry.py`): the ops, backend-agnostic checks, backends
  by name and the `auto` choice;
- the backends (`backends/`): torch (the reference), cpu (C++/OpenMP), cuda (NVRTC), emu (the CUDA
  sources on the CPU), each declaring what it supports;
- the toolchain (`toolchain/`): NVRTC, the host compiler and emulator build, the on-disk cache, the
  ahead-of-time build CLI.

`limits.py` defines the supported dtypes, block sizes and default partition size once.
"""

from __future__ import annotations

from paged.kernels.backends.interface import KernelBackend
from paged.kernels.ops import (
    V3_BACKENDS,
    choose_version,
    copy_blocks,
    copy_slots,
    paged_attention,
    prefill_attention,
    reshape_and_cache,
    step_version,
    swap_blocks,
)
from paged.kernels.registry import BACKENDS, backends_serving, get_backend, resolve_backend

__all__ = [
    "BACKENDS",
    "V3_BACKENDS",
    "KernelBackend",
    "backends_serving",
    "choose_version",
    "copy_blocks",
    "copy_slots",
    "get_backend",
    "paged_attention",
    "prefill_attention",
    "reshape_and_cache",
    "resolve_backend",
    "step_version",
    "swap_blocks",
]
