"""The roofline of experiments/cpu/bench_vs_vllm.py: the workload's FLOPs, and this CPU's GEMM peak in the run's dtype.

A "% of the roofline" is only as honest as its peak, so the peak is measured here, in the dtype the
benchmark runs (fp32 and bf16 GEMMs differ ~3x on a CPU with AVX512-BF16), and it is the best of
every GEMM path on offer: torch's `F.linear`, the prepacked oneDNN matmul (`paged/model/linear.py`,
`Linear(weight, None, "onednn")`), which beats `F.linear` at the model's shapes (issue 15: ~200
against ~180 fp32 GFLOP/s), and paged's packed AVX-512 loop (`Linear(weight, None, "packed")`, what
`model.gemm=auto` runs where the CPU has it). A peak below what paged itself reaches would flatter
every row. Each path runs at the model's fused
shapes (512 rows) and at 2048^3, on all cores; every number is printed, so the reader sees where
the peak comes from.

Workload FLOPs = per request 2 x (non-embedding matmul params) x (prompt + output - 1 tokens)
+ 2 x (lm_head params) x output + 4 x layers x heads x head_dim x (context per processed token,
summed); roofline tok/s = useful tokens / (FLOPs / peak).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from paged.model.arch import LlamaArch
from paged.model.linear import Linear, onednn_unsupported_reason, packed_unsupported_reason

SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass
class MatmulPeak:
    """GFLOP/s per "kernel shape" in one dtype; `onednn_skipped` and `packed_skipped` say why the prepacked
    oneDNN path or the packed loop was not measured."""

    dtype: str
    gflops: dict[str, float]
    onednn_skipped: str | None = None
    packed_skipped: str | None = None

    @property
    def peak(self) -> float:
        return max(self.gflops.values())

    @property
    def best(self) -> str:
        return max(self.gflops, key=self.gflops.__getitem__)

    def describe(self) -> str:
        """One line per kernel, every measurement, then the peak and where it was reached."""
        lines = [f"{SHORT_DTYPE.get(self.dtype, self.dtype)} matmul GFLOP/s (best of each, all cores):"]
        for kernel in dict.fromkeys(key.split(" ")[0] for key in self.gflops):
            shapes = ", ".join(f"{key.split(' ', 1)[1]} {value:.0f}" for key, value in self.gflops.items()
                               if key.startswith(kernel + " "))
            lines.append(f"  {kernel}: {shapes}")
        if self.onednn_skipped:
            lines.append(f"  onednn (prepacked): not measured, {self.onednn_skipped}")
        if self.packed_skipped:
            lines.append(f"  packed (paged's AVX-512 loop): not measured, {self.packed_skipped}")
        lines.append(f"  peak: {self.peak:.0f} GFLOP/s ({self.best})")
        return "\n".join(lines)


def matmul_shapes(arch: LlamaArch) -> dict[str, tuple[int, int]]:
    """(in, out) features of the model's linear layers, fused as paged runs them."""
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    return {
        "qkv": (arch.hidden_size, qkv),
        "o_proj": (arch.num_heads * arch.head_dim, arch.hidden_size),
        "gate_up": (arch.hidden_size, 2 * arch.intermediate_size),
        "down": (arch.intermediate_size, arch.hidden_size),
        "lm_head": (arch.hidden_size, arch.vocab_size),
    }


def workload_flops(arch: LlamaArch, prompts: list[list[int]], outputs: list[int]) -> float:
    """Matmul and attention FLOPs of serving the requests without any waste (no padding, no recompute)."""
    shapes = matmul_shapes(arch)
    layer_params = sum(i * o for name, (i, o) in shapes.items() if name != "lm_head") * arch.num_layers
    lm_head_params = arch.hidden_size * arch.vocab_size
    attention_per_key = 4 * arch.num_layers * arch.num_heads * arch.head_dim  # QK^T and PV
    total = 0.0
    for prompt, out in zip(prompts, outputs):
        processed = len(prompt) + out - 1  # the last output token is never fed back
        total += 2 * layer_params * processed + 2 * lm_head_params * out
        total += attention_per_key * processed * (processed + 1) / 2  # token i attends to i + 1 keys
    return total


def _best_seconds(call: Callable[[], torch.Tensor], repeats: int) -> float:
    call()  # the first call allocates and picks the kernel
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best


def measure_roofline(arch: LlamaArch, dtype: str = "float32", tokens: int = 512, gemm_size: int = 2048,
                     repeats: int = 5) -> MatmulPeak:
    """GFLOP/s of `F.linear`, prepacked oneDNN linears and the packed loop in `dtype`, at the model's shapes and
    gemm_size^3 (a shape the loop cannot tile is timed on the oneDNN layer `packed` leaves it to)."""
    torch_dtype = getattr(torch, dtype)
    shapes = {name: (tokens, i, o) for name, (i, o) in matmul_shapes(arch).items()}
    shapes[f"{gemm_size}^3"] = (gemm_size, gemm_size, gemm_size)
    cpu = torch.device("cpu")
    skipped = {"onednn": onednn_unsupported_reason(torch_dtype, cpu),
               "packed": packed_unsupported_reason(torch_dtype, cpu)}
    previous = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    gflops: dict[str, float] = {}
    try:
        with torch.inference_mode():
            for kernel in ("F.linear", "onednn", "packed"):
                if skipped.get(kernel):
                    continue
                for name, (m, k, n) in shapes.items():
                    x, w = torch.randn(m, k, dtype=torch_dtype), torch.randn(n, k, dtype=torch_dtype)
                    call = partial(F.linear, x, w) if kernel == "F.linear" else partial(Linear(w, None, kernel), x)
                    seconds = _best_seconds(call, repeats)
                    gflops[f"{kernel} {name}"] = 2 * m * k * n / seconds / 1e9
    finally:
        torch.set_num_threads(previous)
    return MatmulPeak(dtype, gflops, skipped["onednn"], skipped["packed"])
