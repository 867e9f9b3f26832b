"""`Hardware`: the resolved numbers of one simulated GPU (and how many of them), from `cfg.hardware`.

A datasheet GPU's values come straight from its YAML; `cpu-local` (`calibrated: true`) has its nulls
filled by the builder from this machine's calibration for the config being simulated
(`paged.sim.calibrate`).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, fields
from typing import Any

from paged.config import ConfigError, HardwareConfig, parse_bytes


@dataclass(frozen=True)
class Hardware:
    name: str
    flops_fp16: float  # dense tensor-core fp16/bf16 FLOP/s per GPU
    flops_fp32: float
    memory_bandwidth: float  # B/s per GPU
    memory: int  # bytes per GPU
    interconnect_bandwidth: float  # B/s per GPU, one direction (NVLink; PCIe where there is none)
    pcie_bandwidth: float
    num_sms: int
    num_gpus: int
    matmul_efficiency: tuple[tuple[float, float], ...]  # (tokens, achieved / peak), tokens ascending
    matmul_tile: int  # GEMM output tile edge for wave quantization; 0: none (a CPU)
    memory_efficiency: float
    prefill_attention_efficiency: float
    decode_attention_efficiency: float
    kernel_launch_s: float
    allreduce_latency_s: float
    pcie_latency_s: float
    step_overhead_s: float
    seq_overhead_s: float
    # B/s of the disk under a prefix tier (`allocator.offload.disk_path`); None: not given (no disk tier)
    disk_bandwidth: float | None = None

    def peak_flops(self, dtype_bytes: int) -> float:
        return self.flops_fp32 if dtype_bytes == 4 else self.flops_fp16

    def matmul_efficiency_at(self, tokens: int) -> float:
        """The table's efficiency at `tokens`, linear in log(tokens), flat beyond its ends."""
        table = self.matmul_efficiency
        xs = [t for t, _ in table]
        i = bisect.bisect_left(xs, tokens)
        if i == 0:
            return table[0][1]
        if i == len(table):
            return table[-1][1]
        (t0, e0), (t1, e1) = table[i - 1], table[i]
        w = (math.log(tokens) - math.log(t0)) / (math.log(t1) - math.log(t0))
        return e0 + w * (e1 - e0)


# values a hardware may leave unset: only a feature that needs one asks for it
_OPTIONAL = ("disk_bandwidth",)


def resolve_hardware(cfg: HardwareConfig | Any, measured: dict[str, Any] | None = None) -> Hardware:
    """`cfg`'s values, nulls filled from `measured` (the calibration); every value checked."""
    values = {f.name: getattr(cfg, f.name) for f in fields(Hardware)}
    for key, value in (measured or {}).items():
        if values.get(key) is None:
            values[key] = value
    missing = sorted(k for k, v in values.items() if v is None and k not in _OPTIONAL)
    if missing and cfg.calibrated:
        raise ConfigError(
            f"hardware={cfg.name} leaves {', '.join(missing)} unset: they are measured on this machine; build "
            "the engine with paged.engine.builder.build_engine (it measures them once and caches them) or run "
            "python experiments/sim/calibrate.py"
        )
    if missing:
        raise ConfigError(f"hardware={cfg.name} leaves {', '.join(missing)} unset; give them in its YAML")
    values["memory"] = parse_bytes(values["memory"], "hardware.memory")
    table = sorted((float(t), float(e)) for t, e in values["matmul_efficiency"])
    if not table or any(t < 1 or not 0 < e <= 1 for t, e in table):
        raise ConfigError(
            f"hardware.matmul_efficiency={values['matmul_efficiency']!r} must be "
            "[[tokens >= 1, efficiency in (0, 1]], ...]"
        )
    values["matmul_efficiency"] = tuple(table)
    for key in ("memory_efficiency", "prefill_attention_efficiency", "decode_attention_efficiency"):
        if not 0 < values[key] <= 1:
            raise ConfigError(f"hardware.{key}={values[key]!r} must be in (0, 1]")
    for key in ("flops_fp16", "flops_fp32", "memory_bandwidth", "interconnect_bandwidth", "pcie_bandwidth",
                "num_sms", "num_gpus", "disk_bandwidth"):
        if values[key] is not None and values[key] <= 0:
            raise ConfigError(f"hardware.{key}={values[key]!r} must be > 0")
    for key in ("matmul_tile", "kernel_launch_s", "allreduce_latency_s", "pcie_latency_s", "step_overhead_s",
                "seq_overhead_s"):
        if values[key] < 0:
            raise ConfigError(f"hardware.{key}={values[key]!r} must be >= 0")
    return Hardware(**values)
