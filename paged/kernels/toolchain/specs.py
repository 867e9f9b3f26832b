"""Kernel instantiations: which template arguments exist and which compile unit each op needs.

A `Unit` is what one op configuration launches (v2 needs its reduce kernel too), and it is the
granularity of lazy compilation and of the on-disk caches of both native backends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged.kernels.limits import BLOCK_SIZES, DEFAULT_PARTITION_SIZE, NATIVE_HEAD_SIZES

NUM_THREADS = 128
CXX_TYPES = {torch.float32: "float", torch.float16: "__half", torch.bfloat16: "__nv_bfloat16"}
OPS = ("attention_v1", "attention_v2", "cache")


@dataclass(frozen=True, order=True)
class Unit:
    op: str
    dtype: str
    head_size: int = 0
    block_size: int = 0
    partition_size: int = 0

    def __post_init__(self) -> None:
        assert self.op in OPS, self.op
        assert self.dtype in CXX_TYPES.values(), self.dtype
        assert (self.op == "attention_v2") == (self.partition_size > 0), self

    @property
    def kernels(self) -> tuple[str, ...]:
        """C++ name expressions of the kernels this unit launches."""
        t, h, b, p = self.dtype, self.head_size, self.block_size, self.partition_size
        if self.op == "attention_v1":
            return (f"paged::paged_attention_v1_kernel<{t}, {h}, {b}, {NUM_THREADS}>",)
        if self.op == "attention_v2":
            return (
                f"paged::paged_attention_v2_kernel<{t}, {h}, {b}, {NUM_THREADS}, {p}>",
                f"paged::paged_attention_v2_reduce_kernel<{t}, {h}, {NUM_THREADS}, {p}>",
            )
        return (f"paged::reshape_and_cache_kernel<{t}>", f"paged::copy_blocks_kernel<{t}>")

    @property
    def label(self) -> str:
        if self.op == "cache":
            return f"cache {self.dtype}"
        label = f"{self.op.removeprefix('attention_')} {self.dtype} h{self.head_size} b{self.block_size}"
        return label + (f" p{self.partition_size}" if self.partition_size else "")


def attention_unit(dtype: torch.dtype, head_size: int, block_size: int, version: str, partition_size: int) -> Unit:
    if version == "v1":
        return Unit("attention_v1", CXX_TYPES[dtype], head_size, block_size)
    return Unit("attention_v2", CXX_TYPES[dtype], head_size, block_size, partition_size)


def cache_unit(dtype: torch.dtype) -> Unit:
    return Unit("cache", CXX_TYPES[dtype])


def dispatchable_units(partition_size: int = DEFAULT_PARTITION_SIZE) -> list[Unit]:
    """Every unit the front end can pick with the given v2 partition size."""
    units = [cache_unit(dtype) for dtype in CXX_TYPES]
    for dtype in CXX_TYPES:
        for head in NATIVE_HEAD_SIZES:
            for block in BLOCK_SIZES:
                units += [attention_unit(dtype, head, block, v, partition_size) for v in ("v1", "v2")]
    return units


def default_units() -> list[Unit]:
    """The configurations models run with most: fp16/bf16, head 128, block 16."""
    units = []
    for dtype in (torch.float16, torch.bfloat16):
        units.append(cache_unit(dtype))
        units += [attention_unit(dtype, 128, 16, v, DEFAULT_PARTITION_SIZE) for v in ("v1", "v2")]
    return units
