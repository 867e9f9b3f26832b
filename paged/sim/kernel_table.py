"""Decode-attention efficiency by hardware, kernel variant and shape class: what `executor=sim
kernel=v1|v2|v3` prices for the kernel it names.

Every hardware gets a row for each (variant, shape class). A measured row holds one cell of a kernel
benchmark table (`experiments/gpu/kernel_bench.py`: 64 query / 8 KV heads, head 128, block 16, fp16,
v2's 512-token partitions) with the document and session it comes from; its efficiency is the one at
which `decode_attention.decode_bytes` of that cell takes the measured time on the hardware's
datasheet bandwidth, so the simulator reproduces that cell exactly and extrapolates from it to other
shapes of its class. A row with no measurement says so in its source and uses the hardware's
`decode_attention_efficiency` (conf/hardware/*.yaml: a literature value, on h200 its measured v3; on cpu-local, this
machine's calibration of the version its executor resolves).

Shape classes (`shape_class`) split the batches where the measured efficiencies differ most: few
sequences (under 16, where the batch alone leaves SMs idle and the largest unit sets the time), many
sequences, and many over contexts past 8192 tokens (vLLM's v1 limit, where v1 on an H100 fell from
~27% to 16-19% of the datasheet bandwidth). Each class's measured row is the issue's target shape
where the class has one (1x16384, 64x4096), else the class's largest measured batch (256x16384).
"""

from __future__ import annotations

from dataclasses import dataclass

from paged.config.choices import VERSIONS
from paged.sim.decode_attention import AttentionShape, decode_bytes
from paged.sim.hardware import Hardware

SHAPE_CLASSES = ("few", "many", "many-long")
FEW_SEQS = 16
LONG_CONTEXT = 8192
# The kernel benchmark's attention shape, which every measured row was taken at.
BENCH_SHAPE = AttentionShape(heads=64, kv_heads=8, head_dim=128, dtype_bytes=2, kv_bytes=2, block_size=16,
                             partition_size=512)

_H100_SESSION = ("docs/gpu.md, 'NVIDIA H100 80GB HBM3 (issue 13's session, 2026-11-22)', kernel latency table "
                 "(python experiments/gpu/kernel_bench.py --repeats 7, CUDA graphs, inputs rotated past L2), fp16")
_H100_V3_SESSION = ("experiments/results/gpu/2026-11-26-nvidia-h100-80gb-hbm3.md (issue 33's session), decode table "
                    "(python experiments/gpu/kernel_bench.py --repeats 5, CUDA graphs, inputs rotated past L2), fp16")
# The landed main of 2026-11-28 on one H200 (issue 44's Why), copied into docs/simulator.md's H200
# table: rows `64 4096 fp16 =` and `1 16384 fp16 =`, columns v1 / v2 / v3 µs. It has no 256x16384
# row, so the many-long class stays unmeasured there.
_H200_SESSION = ("../shared/reference/gpu-runs/2026-11-28-h200-kernel-bench.txt (issue 44's H200 run of the landed "
                 "main), decode table (experiments/gpu/kernel_bench.py, median of 5 CUDA-graph replays, inputs "
                 "rotated), fp16, kv =")


@dataclass(frozen=True)
class Measurement:
    """One cell of a kernel benchmark table at `BENCH_SHAPE`: `num_seqs` x `context`, µs per call."""

    num_seqs: int
    context: int
    us: float
    source: str


# (hardware, variant, shape class) -> the measured cell it is fitted to. What is not here is unmeasured.
MEASURED: dict[tuple[str, str, str], Measurement] = {
    ("h100-sxm", "v1", "few"): Measurement(1, 16384, 644.8, _H100_SESSION),
    ("h100-sxm", "v2", "few"): Measurement(1, 16384, 91.3, _H100_SESSION),
    ("h100-sxm", "v1", "many"): Measurement(64, 4096, 1185.0, _H100_SESSION),
    ("h100-sxm", "v2", "many"): Measurement(64, 4096, 1175.0, _H100_SESSION),
    ("h100-sxm", "v1", "many-long"): Measurement(256, 16384, 26730.0, _H100_SESSION),
    ("h100-sxm", "v2", "many-long"): Measurement(256, 16384, 18671.0, _H100_SESSION),
    ("h100-sxm", "v3", "few"): Measurement(1, 16384, 54.9, _H100_V3_SESSION),
    ("h100-sxm", "v3", "many"): Measurement(64, 4096, 397.7, _H100_V3_SESSION),
    ("h100-sxm", "v3", "many-long"): Measurement(256, 16384, 5603.4, _H100_V3_SESSION),
    ("h200", "v1", "few"): Measurement(1, 16384, 655.9, _H200_SESSION),
    ("h200", "v2", "few"): Measurement(1, 16384, 88.7, _H200_SESSION),
    ("h200", "v3", "few"): Measurement(1, 16384, 50.3, _H200_SESSION),
    ("h200", "v1", "many"): Measurement(64, 4096, 1166.5, _H200_SESSION),
    ("h200", "v2", "many"): Measurement(64, 4096, 1074.5, _H200_SESSION),
    ("h200", "v3", "many"): Measurement(64, 4096, 315.1, _H200_SESSION),
}


@dataclass(frozen=True)
class Entry:
    """One row: the efficiency (achieved / datasheet bandwidth) and where it comes from."""

    variant: str
    shape: str
    efficiency: float
    source: str


def shape_class(num_seqs: int, longest: int) -> str:
    """The shape class of a decode batch of `num_seqs` rows whose longest context is `longest`."""
    if num_seqs < FEW_SEQS:
        return "few"
    return "many-long" if longest > LONG_CONTEXT else "many"


def fitted_efficiency(hw: Hardware, variant: str, cell: Measurement) -> float:
    """The efficiency at which the cost model's bytes for `cell` take its measured time on `hw`."""
    work = decode_bytes(variant, [cell.context] * cell.num_seqs, cell.num_seqs * cell.context, BENCH_SHAPE,
                        hw.num_sms)
    return min(1.0, work / (hw.memory_bandwidth * cell.us * 1e-6))


def _default_source(hw: Hardware, variant: str) -> str:
    value = f"hardware.decode_attention_efficiency={hw.decode_attention_efficiency:g}"
    if hw.name == "cpu-local":
        return f"calibrated: {value}, this machine's measurement of the version its executor resolves"
    return (f"unmeasured (no kernel benchmark of {variant} on {hw.name}): {value}, "
            f"the default in conf/hardware/{hw.name}.yaml (its comment gives the source)")


def decode_table(hw: Hardware) -> dict[tuple[str, str], Entry]:
    """Every (variant, shape class) of `hw`: fitted to its measurement where there is one, else the
    hardware's default, with the source saying which."""
    table = {}
    for variant in VERSIONS:
        for shape in SHAPE_CLASSES:
            cell = MEASURED.get((hw.name, variant, shape))
            if cell is None:
                entry = Entry(variant, shape, hw.decode_attention_efficiency, _default_source(hw, variant))
            else:
                source = f"measured: {cell.source}, {cell.num_seqs}x{cell.context} {cell.us:g} µs"
                entry = Entry(variant, shape, fitted_efficiency(hw, variant, cell), source)
            table[variant, shape] = entry
    return table
