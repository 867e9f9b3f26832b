"""The model's and the KV cache's dtypes against the device and the named kernel backend, checked once
the device is resolved and before any weights load, so a bad pair fails at once.

On a CPU, float32 runs everywhere. bfloat16 does too, but only a CPU with AVX512-BF16 or AMX multiplies
bf16 natively (oneDNN's bf16 GEMMs); elsewhere its matmuls widen to fp32 and narrow back, slower than
a float32 run, and the run says so once. float16 is refused: no CPU path here is built or tuned for
it, and `auto` never picks it on a CPU (it picks bfloat16 where the CPU has bf16 arithmetic, else float32:
`paged.config.dtype`) (the kernels still take fp16 tensors when called directly, as
the tests against the torch reference do).

`kernel.kv_cache_dtype` may name a float dtype other than the model's (a bf16 model over an fp32
cache); a backend that keeps its cache in the activations' dtype refuses the pair
(`KernelBackend.unsupported_reason`), which `auto` then passes over.
"""

from __future__ import annotations

import logging

import torch

from paged import kernels
from paged.config import ConfigError, KernelConfig
from paged.config.dtype import bf16_arithmetic_supported
from paged.kernels.features import cache_dtype

log = logging.getLogger(__name__)

# model.dtype values (auto resolved) a model may run in on a CPU
CPU_DTYPES = ("float32", "bfloat16")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_cpu_dtype(dtype: torch.dtype) -> None:
    """A ConfigError naming the supported dtypes for a model dtype a CPU does not run; a warning for
    bfloat16 on a CPU without bf16 arithmetic (it runs, slower)."""
    if _name(dtype) not in CPU_DTYPES:
        raise ConfigError(f"model.dtype={_name(dtype)} does not run on a CPU; supported there: {', '.join(CPU_DTYPES)}")
    if dtype == torch.bfloat16 and not bf16_arithmetic_supported():
        log.warning("model.dtype=bfloat16 on a CPU without AVX512-BF16 or AMX: its bf16 matmuls run emulated "
                    "through fp32, typically slower than model.dtype=float32 on this CPU")


def check_dtypes(dtype: torch.dtype, kernel: KernelConfig, device: torch.device) -> None:
    """The model dtype on `device` (`check_cpu_dtype` on a CPU), and whether a backend named by
    `kernel.backend` serves the model and cache dtypes there (`auto` picks one that does)."""
    if device.type == "cpu":
        check_cpu_dtype(dtype)
    if kernel.backend == "auto":
        return
    cache = cache_dtype(kernel.kv_cache_dtype, dtype)
    # head and block sizes are not known yet: None leaves them to the check once they are
    reason = kernels.get_backend(kernel.backend).unsupported_reason(device, dtype, None, None, cache_dtype=cache)
    if reason:
        raise ConfigError(f"kernel.backend={kernel.backend} cannot run model.dtype={_name(dtype)} with "
                          f"kernel.kv_cache_dtype={kernel.kv_cache_dtype} on {device}: {reason}")
